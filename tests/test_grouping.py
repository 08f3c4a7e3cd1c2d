"""Cube reordering (dsv_ext.grouping): permutation round trips, cube contiguity, odd grids."""
import itertools

import pytest
import torch

from dsv_ext.grouping import check_grid, clear_cache, cube_permutation, reorder, restore

GRIDS = [(1, 1, 1), (2, 4, 4), (4, 8, 8), (3, 5, 7), (5, 3, 9), (1, 7, 3), (3, 1, 1), (7, 6, 5)]
CUBES = [(2, 4, 4), (1, 2, 2), (3, 3, 3), (4, 8, 8)]


def _coords(grid):
    T, H, W = grid
    return [(t, h, w) for t in range(T) for h in range(H) for w in range(W)]


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("cube", CUBES)
def test_round_trip_and_cube_order(grid, cube):
    S = grid[0] * grid[1] * grid[2]
    perm, inv = cube_permutation(grid, cube, S)
    assert perm.dtype == torch.int64 and inv.dtype == torch.int64
    assert sorted(perm.tolist()) == list(range(S))
    x = torch.randn(2, S, 3, 5, dtype=torch.float64)
    y = reorder(x, perm)
    assert torch.equal(y[:, 0], x[:, perm[0]])
    assert torch.equal(restore(y, inv), x)
    assert torch.equal(perm[inv], torch.arange(S))
    # the cube id of consecutive reordered tokens never decreases (each cube is contiguous) and
    # inside a cube the tokens are in raster order
    coords = _coords(grid)
    ct, ch, cw = (min(c, g) for c, g in zip(cube, grid))
    nch, ncw = -(-grid[1] // ch), -(-grid[2] // cw)
    ids = []
    for p in perm.tolist():
        t, h, w = coords[p]
        ids.append(((t // ct) * nch + h // ch) * ncw + w // cw)
    assert ids == sorted(ids)
    for cid, run in itertools.groupby(zip(ids, perm.tolist()), key=lambda a: a[0]):
        members = [p for _, p in run]
        assert members == sorted(members)
        ts, hs, ws = zip(*(coords[p] for p in members))
        assert max(ts) - min(ts) < ct and max(hs) - min(hs) < ch and max(ws) - min(ws) < cw
    # full cubes have exactly the cube volume
    if all(g % c == 0 for g, c in zip(grid, (ct, ch, cw))):
        vol = ct * ch * cw
        assert all(ids[i] == i // vol for i in range(S))


def test_divisible_grid_first_cube():
    perm, _ = cube_permutation((2, 8, 8), (2, 4, 4))
    # first cube: t in {0,1}, h in 0..3, w in 0..3 of an 8x8 frame, raster inside the cube
    want = [t * 64 + h * 8 + w for t in range(2) for h in range(4) for w in range(4)]
    assert perm[:32].tolist() == want


def test_extra_tokens_keep_their_place():
    perm, inv = cube_permutation((3, 5, 7), (2, 4, 4), seq_len=105 + 11)
    assert perm[105:].tolist() == list(range(105, 116))
    assert sorted(perm[:105].tolist()) == list(range(105))
    x = torch.randn(1, 116, 2)
    assert torch.equal(restore(reorder(x, perm), inv), x)


def test_cache_and_device():
    clear_cache()
    a = cube_permutation((3, 5, 7), (2, 4, 4), device="cpu")
    b = cube_permutation([3, 5, 7], [2, 4, 4], device=torch.device("cpu"))
    assert a[0] is b[0] and a[1] is b[1]
    c = cube_permutation((3, 5, 7), (1, 2, 2))
    assert c[0] is not a[0]


def test_bad_grids():
    with pytest.raises(ValueError, match="^grid"):
        cube_permutation((3, 0, 2))
    with pytest.raises(ValueError, match="^grid"):
        cube_permutation((3, 4))
    with pytest.raises(ValueError, match="^grid"):
        cube_permutation((3, 4, 5), seq_len=50)
    with pytest.raises(ValueError, match="^cube"):
        cube_permutation((3, 4, 5), cube=(2, 0, 2))
    with pytest.raises(ValueError, match="^grid"):
        check_grid(None)


def test_non_integer_grids_raise_instead_of_truncating():
    """(2.5, 4, 4) used to become (2, 4, 4) silently (a wrong cube order for the real grid)."""
    import numpy as np
    for bad in [(2.5, 4, 4), ("2", "4", "4"), "244", (2, 4, "x")]:
        with pytest.raises((ValueError, TypeError), match="^grid"):
            check_grid(bad)
    assert check_grid((2.0, np.int64(4), torch.tensor(4))) == (2, 4, 4)
