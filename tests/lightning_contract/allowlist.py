"""Lightning tests that may pass with Lightning's strategy and not with ours, each with its reason.

Every reason is a deliberate difference listed in ``docs/explanations/compatibility.md``; the key is the anchor of its
section there (``tests/lightning_contract/test_lightning_contract.py`` checks that each one exists).
"""

from __future__ import annotations

from fnmatch import fnmatch

# anchor in docs/explanations/compatibility.md -> why the test cannot pass with our strategy
REASONS: dict[str, str] = {
    "error-messages": (
        "the error names our strategy class and says more (what is there, the fix); the test matches"
        " Lightning's wording or class name"
    ),
    "model-parallel-sizes": (
        "data_parallel_size / tensor_parallel_size do not apply to fsdp_blocks and hsdp (they shard over all"
        " ranks / shard_size); tp_dp takes them and refuses a wrong product with ValueError, not RuntimeError"
    ),
    "configure_model-is-optional": (
        "our strategies parallelize the model themselves, so configure_model is optional where"
        " ModelParallelStrategy requires it"
    ),
    "set-up-order": (
        "the parallel sizes and the device mesh are built in setup_environment(), the mesh by ParallelDims"
        " (not Lightning's _setup_device_mesh); the test sets private attributes and calls setup() without"
        " it, or mocks _setup_device_mesh and the process group"
    ),
    "pp_dp-needs-a-pipeline": (
        "pp_dp refuses at set-up a world that pipeline_parallel_size (default 2) does not divide (one process),"
        " a model with no container of repeated blocks to cut into stages, and save_distributed_checkpoint"
        " (its checkpoints are always distributed)"
    ),
    "meta-device-states-must-be-initialised": (
        "a meta-device tensor that no initialiser writes is refused (UninitializedStateError, before any work)"
        " where Lightning warns and leaves it as uninitialised memory"
    ),
    "foreign-destinations": (
        "a checkpoint is never written into, or over, something the package did not write: a folder that"
        " is not a checkpoint is refused (ForeignFolderError, an IsADirectoryError) with the fix"
    ),
}

_MP = ("fsdp_blocks", "hsdp", "tp_dp")
_ALL_MP = (*_MP, "pp_dp")
_PP = ("pp_dp",)
_MP_TESTS = "strategies/test_model_parallel.py::"

# (modes, test id pattern relative to tests_pytorch, anchor)
ALLOWED: list[tuple[tuple[str, ...], str, str]] = [
    (_MP, _MP_TESTS + "test_set_timeout", "set-up-order"),
    (_ALL_MP, _MP_TESTS + "test_torch_greater_equal_2_4", "error-messages"),
    (_ALL_MP, _MP_TESTS + "test_fsdp_v1_modules_unsupported", "error-messages"),
    (_ALL_MP, _MP_TESTS + "test_save_checkpoint_storage_options", "error-messages"),
    (_ALL_MP, _MP_TESTS + "test_load_unknown_checkpoint_type", "error-messages"),
    (_MP, _MP_TESTS + "test_save_checkpoint_path_exists", "foreign-destinations"),
    (_ALL_MP, _MP_TESTS + "test_validate_device_mesh_dimensions[[]*", "model-parallel-sizes"),
    (_MP, _MP_TESTS + "test_configure_model_required", "configure_model-is-optional"),
    (_MP, _MP_TESTS + "test_meta_device_materialization", "meta-device-states-must-be-initialised"),
    # pp_dp: one process, or Lightning's two-layer test models, are not a pipeline
    (_PP, _MP_TESTS + "test_set_timeout", "pp_dp-needs-a-pipeline"),
    (_PP, _MP_TESTS + "test_save_checkpoint_path_exists", "pp_dp-needs-a-pipeline"),
    (_PP, _MP_TESTS + "test_configure_model_required", "pp_dp-needs-a-pipeline"),
    (_PP, _MP_TESTS + "test_meta_device_materialization", "pp_dp-needs-a-pipeline"),
    (
        _PP,
        "trainer/connectors/test_accelerator_connector.py::test_precision_selection_model_parallel[[]*-False]",
        "pp_dp-needs-a-pipeline",
    ),
]


def allowed_difference(mode: str, test: str) -> str | None:
    """The documented reason ``test`` may fail with ``mode`` where Lightning's strategy passes, else None."""
    rel = test.split("tests_pytorch/", 1)[-1]
    for modes, pattern, anchor in ALLOWED:
        if mode in modes and fnmatch(rel, pattern):
            return f"{anchor}: {REASONS[anchor]}"
    return None
