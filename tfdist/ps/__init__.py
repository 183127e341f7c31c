"""The parameter-server runtime: connection, master variables, update policies, the updater."""
