"""ParallelDims: every size validated together, with the arithmetic in the message (no process group)."""

from __future__ import annotations

import pytest

from lit_parallel.parallel import ParallelDims, divisors


def test_sizes_that_do_not_multiply_to_the_world_size_show_the_arithmetic():
    with pytest.raises(ValueError) as err:
        ParallelDims(world_size=8, data_parallel_replicate=2, data_parallel_shard=3, tensor_parallel=2)
    assert (
        "data_parallel_replicate(2) * data_parallel_shard(3) * tensor_parallel(2) = 12 != world size (8)"
        in str(err.value)
    )


def test_shard_size_minus_one_takes_the_ranks_left_over():
    dims = ParallelDims(world_size=8, data_parallel_replicate=2, tensor_parallel=2)
    assert dims.data_parallel_shard == 2 and dims.data_parallel == 4
    assert dims.shape == (2, 2, 2) and dims.replicate_enabled and dims.tp_enabled
    with pytest.raises(
        ValueError, match=r"data_parallel_replicate\(3\) \* tensor_parallel\(1\) = 3 does not divide"
    ):
        ParallelDims(world_size=8, data_parallel_replicate=3)


def test_mesh_dimension_names_follow_lightning():
    flat = ParallelDims(world_size=4)
    assert flat.mesh_dim_names == ("data_parallel", "tensor_parallel")
    assert flat.fsdp_dim_names == ("data_parallel",)
    hybrid = ParallelDims.for_hybrid_shard(4, 2)
    assert hybrid.mesh_dim_names == ("data_parallel_replicate", "data_parallel_shard", "tensor_parallel")
    assert hybrid.fsdp_dim_names == ("data_parallel_replicate", "data_parallel_shard")
    assert (hybrid.data_parallel_replicate, hybrid.data_parallel_shard) == (2, 2)


def test_hybrid_shard_size_must_divide_the_world_size():
    with pytest.raises(ValueError, match="shard_size=3 does not divide world size 4; choose 1, 2 or 4"):
        ParallelDims.for_hybrid_shard(4, 3)
    with pytest.raises(ValueError, match="shard_size=0 must be a positive integer"):
        ParallelDims.for_hybrid_shard(4, 0)
    assert ParallelDims.for_hybrid_shard(8, 2, tensor_parallel=2).shape == (2, 2, 2)


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "2"])
def test_non_positive_or_non_integer_sizes_are_refused(bad):
    with pytest.raises(ValueError, match="must be a positive integer"):
        ParallelDims(world_size=4, tensor_parallel=bad)


def test_divisors():
    assert divisors(12) == [1, 2, 3, 4, 6, 12]
    assert divisors(1) == [1]


def test_each_layout_has_a_constructor_whose_errors_show_the_arithmetic():
    assert ParallelDims.for_ddp(4).shape == (1, 4, 1) and ParallelDims.for_fsdp(4).shape == (1, 4, 1)
    # tp_dp: tensor parallelism stays inside a node unless data parallelism is given
    assert ParallelDims.for_tensor_parallel(num_nodes=2, devices_per_node=4).shape == (1, 2, 4)
    assert ParallelDims.for_tensor_parallel(num_nodes=1, devices_per_node=8, data_parallel=2).shape == (
        1,
        2,
        4,
    )
    three_d = ParallelDims.for_tensor_parallel(
        num_nodes=2, devices_per_node=4, tensor_parallel=2, data_parallel_replicate=2
    )
    assert three_d.shape == (2, 2, 2) and three_d.mesh_dim_names[0] == "data_parallel_replicate"
    with pytest.raises(ValueError, match=r"data_parallel_size=3 does not divide the world size 8"):
        ParallelDims.for_tensor_parallel(num_nodes=2, devices_per_node=4, data_parallel=3)
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size\(3\) \* data_parallel_replicate_size\(1\) = 3"
    ):
        ParallelDims.for_tensor_parallel(num_nodes=1, devices_per_node=4, tensor_parallel=3)


def test_the_mesh_is_owned_by_the_dims_and_refused_before_it_is_built():
    dims = ParallelDims.for_fsdp(2)
    with pytest.raises(RuntimeError, match="not built yet"):
        dims.fsdp_mesh()
