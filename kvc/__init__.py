"""The bottom layer both services import: wire stubs and constants, block keys,
cost priors, tokenization, registry records and the bundled model files.

Importing it turns gRPC's fork handlers off for this process (unless
``GRPC_ENABLE_FORK_SUPPORT`` is set already): gRPC reads the variable once, when it is
first imported, so the entry points import ``kvc`` before anything that imports grpc
(``kvc_cli``, ``bench`` and ``tests`` do so in their ``__init__``). With the handlers
on, a process using gRPC that starts a program (``subprocess.Popen`` with a
``preexec_fn``, as ``kvc_cli.supervisor`` does) forks a child in which gRPC restarts its
poller thread; Popen then closes the poller's epoll descriptor before ``exec`` and the
child can abort ("epoll_wait error: Bad file descriptor", grpc/grpc#43055, open in
grpcio 1.85). Nothing here uses gRPC across a fork: children ``exec`` at once, and the
conductor's workers start by ``spawn``.
"""

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
