"""--backend horovod: the cross-process allreduce from Horovod (Gloo on CPU, NCCL on GPUs).

Run under horovodrun, which starts the processes and ends the job when one of them fails:
    horovodrun -np 2 -H localhost:2 --gloo python -m manual_dp.train --backend horovod --cpus 1
"""
import collections
import itertools
import os

from ..errors import UsageError
from .board import Board, Reporter, bind_address
from .world import Cluster

INSTALL = ("HOROVOD_WITH_MXNET=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 "
           "HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_PYTORCH=1 "
           "pip install --no-build-isolation horovod==0.28.1")


def import_horovod():
    """horovod.mxnet, or a UsageError that says how to install it."""
    try:
        import horovod.mxnet as hvd
    except ImportError as e:
        raise UsageError(f"--backend horovod needs horovod.mxnet ({e}); `bash setup.sh --test` "
                         f"installs it, or: {INSTALL}") from None
    return hvd


class HorovodWorld(Cluster):
    backend = "horovod"
    how = ("gradients summed by hand over each process's contexts, then by Horovod across "
           "processes (one call per all-reduce of the strategy: one a step when fused)")

    def __init__(self, timeout, on_timeout, flight_dir=None):
        self.hvd = import_horovod()
        super().__init__(timeout, on_timeout, flight_dir)
        try:
            self.hvd.init()                           # waits for every process of the job
        except Exception:
            self.watchdog.stop()
            raise
        self.rank, self.size, self.joined = self.hvd.rank(), self.hvd.size(), True
        self.local_rank = self.hvd.local_rank()
        # Names key Horovod's collectives; a fresh one per call, since evaluation may have
        # several counts in flight at once and Horovod refuses two live tensors of one name. The
        # number counts the calls of that key only: sums made inside an autograd backward (sync
        # BatchNorm's) run as the engine reaches them, in an order that may differ between ranks,
        # each under its own key, while the calls of one key keep their order.
        self.calls = collections.defaultdict(itertools.count)
        self.open_board()
        self.open_flight()
        self.progress()

    def open_board(self):
        """Rank 0 keeps the job's progress board (there is no launcher of ours); every rank reports to it."""
        host = os.environ.get("HOROVOD_HOSTNAME", "127.0.0.1")
        self.board = Board(bind_address(host)) if self.is_root else None
        address = self.broadcast_object(f"{host}:{self.board.port}" if self.board else None)
        self.reporter = Reporter(address, slot=f"on {host}")
        self.unanswered = "the board on rank 0 did not answer: rank 0 has probably stopped"

    def name(self, what):
        return f"manual_dp.{what}.{next(self.calls[what])}"

    def allreduce(self, array, key):
        self.collective("allreduce", key, lambda: self.hvd.allreduce_(array, op=self.hvd.Sum, name=self.name(key)),
                        result=array)

    def broadcast_object(self, obj):
        """(The payload's size is rank 0's to know: the flight record leaves it out.)"""
        return self.collective("broadcast", "", lambda: self.hvd.broadcast_object(
            obj, root_rank=0, name=self.name("object")), fallback=obj)

    def close(self, failed=False):
        try:
            if not failed:
                self.hvd.shutdown()
            if getattr(self, "board", None) is not None:
                self.board.close()
        finally:
            super().close(failed)
