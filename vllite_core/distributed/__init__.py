"""Tensor parallelism: which rank this process is, its communicator, and how tensors split over ranks."""
from vllite_core.distributed.parallel_state import TensorParallelState, get_tp, init_tensor_parallel

__all__ = ["TensorParallelState", "get_tp", "init_tensor_parallel"]
