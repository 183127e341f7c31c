"""Launch helpers: a ps server, a local one-command cluster, and the `tfdist-launch` CLI."""

from tfdist.launch.local import LocalCluster
from tfdist.launch.local import LocalClusterResult
from tfdist.launch.local import run_local_cluster
from tfdist.launch.server import serve
from tfdist.launch.server import start_server

__all__ = ["LocalCluster", "LocalClusterResult", "run_local_cluster", "serve", "start_server"]
