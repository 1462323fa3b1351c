"""ParallelMesh: layout arithmetic, validation errors, and the process groups on real ranks."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from lightning_par.mesh import MeshCoords, MeshLayout, ParallelMesh
from tests.distributed import run_distributed


def test_layout_tp_fastest_pp_slowest() -> None:
    layout = MeshLayout(world_size=8, tensor_parallel_size=2, pipeline_parallel_size=2)
    assert layout.data_parallel_size == 2
    assert [tuple(layout.coords(r)) for r in range(8)] == [
        (0, 0, 0),
        (0, 0, 1),
        (0, 1, 0),
        (0, 1, 1),
        (1, 0, 0),
        (1, 0, 1),
        (1, 1, 0),
        (1, 1, 1),
    ]
    for r in range(8):
        assert layout.rank_of(layout.coords(r)) == r
    assert layout.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_layout_groups_partition_the_world() -> None:
    layout = MeshLayout(world_size=12, tensor_parallel_size=2, pipeline_parallel_size=3)
    for dim in ("pp", "dp", "tp"):
        groups = layout.groups(dim)  # type: ignore[arg-type]
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(12))
        assert all(len(g) == layout.size(dim) for g in groups)  # type: ignore[arg-type]
    assert layout.coords(7) == MeshCoords(pp=1, dp=1, tp=1)


@pytest.mark.parametrize(
    ("world", "tp", "pp", "message"),
    [
        (4, 3, 1, r"tensor_parallel_size=3 x pipeline_parallel_size=1 = 3 does not divide the world size 4"),
        (6, 2, 2, r"must be one of \[1, 2, 3, 6\]"),
        (4, 0, 1, r"tensor_parallel_size must be a positive integer, got 0"),
        (4, 1, -2, r"pipeline_parallel_size must be a positive integer, got -2"),
        (0, 1, 1, r"world_size must be a positive integer"),
    ],
)
def test_layout_rejects_impossible_sizes(world: int, tp: int, pp: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MeshLayout(world_size=world, tensor_parallel_size=tp, pipeline_parallel_size=pp)


def test_mesh_needs_initialized_group() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        ParallelMesh()


def _mesh_groups(rank: int, world: int) -> dict[str, object]:
    mesh = ParallelMesh(tensor_parallel_size=2, pipeline_parallel_size=1)
    out: dict[str, object] = {
        "coords": tuple(mesh.coords),
        "sizes": (mesh.pp_size, mesh.dp_size, mesh.tp_size),
    }
    for dim in ("tp", "dp", "pp"):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=mesh.group(dim))  # type: ignore[arg-type]
        out[dim] = t.item()
    with pytest.raises(ValueError, match="does not divide the world size 4"):
        ParallelMesh(tensor_parallel_size=3)
    return out


def test_mesh_groups_on_four_ranks() -> None:
    results = run_distributed(_mesh_groups, 4)
    # tp groups {0,1},{2,3}; dp groups {0,2},{1,3}; pp groups are singletons
    assert [r["coords"] for r in results] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert all(r["sizes"] == (1, 2, 2) for r in results)
    assert [r["tp"] for r in results] == [1.0, 1.0, 5.0, 5.0]
    assert [r["dp"] for r in results] == [2.0, 4.0, 2.0, 4.0]
    assert [r["pp"] for r in results] == [0.0, 1.0, 2.0, 3.0]


def _many_meshes(rank: int, world: int) -> dict[str, object]:
    meshes: list[ParallelMesh] = []
    warned_at: list[int] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # Python's own: once per text and place
        for i in range(13):
            seen = len(caught)
            meshes.append(ParallelMesh())
            if any("destroy_process_groups()" in str(w.message) for w in caught[seen:]):
                warned_at.append(i)
    for mesh in meshes:
        mesh.destroy()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ParallelMesh().destroy()
    return {"warned_at": warned_at, "after_destroy": [str(w.message) for w in caught]}


def test_many_live_meshes_are_warned_about_naming_destroy_process_groups() -> None:
    """A loop of Trainers that never destroys its meshes ran out of file descriptors after a few dozen,
    in Gloo's words ("Cannot resolve 127.0.0.1 to a (local) address"); rank 0 now warns once the process
    holds more than 30 groups (the 11th mesh of three), naming destroy_process_groups(), once."""
    results = run_distributed(_many_meshes, 2)
    assert results[0]["warned_at"] == [10], results[0]  # once, not again at the 12th and 13th
    assert results[1]["warned_at"] == [] and results[0]["after_destroy"] == [], results
