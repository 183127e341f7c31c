"""What the strategy and compressor registries share: turning an identifier into an object."""


def resolve(identifier, kwargs, table, kind, instance_type, valid_names):
    """Builds `table[name](**kwargs)` from a name or a `{"name", "config"}` dict.

    An `instance_type` instance is returned as it is. Errors name the `kind` ("strategy",
    "compressor"), list the valid names and echo what was received.
    """
    if isinstance(identifier, instance_type):
        if kwargs:
            raise ValueError(f"keyword arguments go with a {kind} name, not an instance. "
                             f"Received: {sorted(kwargs)}")
        return identifier
    if isinstance(identifier, dict):
        if "name" not in identifier or set(identifier) - {"name", "config"}:
            raise ValueError(f"a {kind} dict has the keys 'name' and 'config'. Received: "
                             f"{identifier!r}")
        kwargs = {**identifier.get("config", {}), **kwargs}
        identifier = identifier["name"]
    if not isinstance(identifier, str):
        raise ValueError(f"`identifier` must be a {kind} name, dict or instance. Received: "
                         f"{identifier!r}")
    key = identifier.strip().lower().replace("-", "_")
    if key not in table:
        raise ValueError(f"Unknown {kind} {identifier!r}. Valid names: {valid_names()}")
    try:
        return table[key](**kwargs)
    except TypeError as e:
        raise ValueError(f"{kind} {key!r} does not take these arguments {sorted(kwargs)}: "
                         f"{e}") from None
