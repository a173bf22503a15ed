"""torch's own CUDA RPC test classes -- TensorPipeAgentCudaRpcTest, TensorPipeCudaDistAutogradTest
(CudaDistAutogradTest), CudaRemoteModuleTest -- run against distgrad through the switch
(``distgrad.patch_torch()`` below, before torch's test modules are imported: in this process
and in every worker process torch's fixture spawns, which imports this module again).

Not collected by the suite (no ``test_`` prefix): ``scripts/gpu_check.sh`` runs it on a GPU
machine, the cases one GPU can run (``ONE_GPU``; the others need two or four GPUs), e.g.::

    python -m pytest tests/e2e/torch_cuda_suites.py -k "$(python tests/e2e/torch_cuda_suites.py)"
"""

from __future__ import annotations

import sys

#: the cases that need one GPU (``skip_if_lt_x_gpu(1)`` or none): read off torch 2.13's suite
ONE_GPU = (
    "test_gpu_simple",
    "test_gpu_to_cpu_continuation",
    "test_gpu_to_cpu_continuation_gpu_root",
    "test_input_moved_to_cuda_device",
    "test_input_moved_to_cuda_device_script",
    "test_invalid_devices",
    "test_valid_device",
    "test_async_execution_nested_with_cuda_future",
    "test_async_execution_with_cuda_future",
    "test_cuda_future_can_extract_cuda_sparse_tensor",
    "test_cuda_future_can_extract_cuda_tensor",
    "test_cuda_future_can_extract_custom_class_with_cuda_sparse_tensor",
    "test_cuda_future_can_extract_custom_class_with_cuda_tensor",
    "test_cuda_future_can_extract_list_with_cuda_sparse_tensor",
    "test_cuda_future_can_extract_list_with_cuda_tensor",
    "test_cuda_future_device_as_device",
    "test_cuda_future_device_as_int",
    "test_cuda_future_device_as_str",
    "test_cuda_future_device_not_cuda",
    "test_cuda_future_modify_tensor_inplace",
    "test_cuda_future_replace_tensor",
    "test_device_map_cpu",
    "test_device_map_cpu_to_gpu_default",
    "test_device_map_gpu_to_cpu_default",
    "test_device_maps_invalid_max_local_device",
    "test_device_maps_invalid_max_remote_device",
    "test_device_maps_invalid_min_device",
    "test_device_maps_missing_config",
    "test_device_maps_missing_config_loop",
    "test_device_maps_missing_config_not_timeout",
    "test_device_maps_missing_config_remote",
    "test_device_maps_missing_config_remote_response",
    "test_device_maps_missing_config_response",
    "test_device_maps_missing_config_response_loop",
    "test_device_mismatch",
    "test_owner_rref_forward_synchronization1",
    "test_rref_as_arg_synchronization1",
    "test_rref_as_arg_synchronization5",
    "test_rref_forward_synchronization1",
    "test_rref_to_here_synchronization1",
    "test_rref_with_unpickleable_attributes",
    "test_tensor_view_as_return_value",
)

if __name__ == "__main__":  # (the -k expression; before anything heavy is imported)
    sys.stdout.write(" or ".join(ONE_GPU))
    sys.exit(0)

import distgrad  # noqa: E402

distgrad.patch_torch()

from torch.testing._internal.distributed.rpc.tensorpipe_rpc_agent_test_fixture import (  # noqa: E402
    TensorPipeRpcAgentTestFixture,
)
from torch.testing._internal.distributed.rpc_utils import (  # noqa: E402
    GENERIC_CUDA_TESTS,
    TENSORPIPE_CUDA_TESTS,
    generate_tests,
)

globals().update(
    generate_tests(
        "TensorPipe",
        TensorPipeRpcAgentTestFixture,
        GENERIC_CUDA_TESTS + TENSORPIPE_CUDA_TESTS,
        __name__,
    )
)
