"""The `slow` interpreter cases: deselected by the default run (`make test`, CI), run by `make test-all`.

Through Triton's interpreter a kernel case costs seconds to minutes, so the default run keeps, for every kernel
path, its fastest cases and leaves out the repetitions: each entry below names cases (fnmatch patterns over pytest
node ids) whose path a faster case of the default run also takes, and says which. They are listed in one place so
that what the fast default covers can be reviewed at a glance; a pattern that no longer matches any case of a file
collected in full stops the run, so renaming a test cannot silently drop it from the list.
"""

from __future__ import annotations

import fnmatch
from pathlib import Path

import pytest

CHAMFER = "tests/ops/chamfer/test_chamfer.py"
QUANTIZED = "tests/ops/maxsim/test_quantized.py"
WIDTHS = "tests/ops/maxsim/test_widths.py"
BACKWARD = "tests/ops/maxsim/test_backward_paths.py"

# pattern -> why the default run does not need it (ids are `[launch-norm-dim]` and the like).
SLOW = {
    # Dimensions 1, 3, 8, 9, 14, 15 and 64 stay: both sides of each route's dimension bounds and a wide set.
    f"{CHAMFER}::test_nearest_matches_dense_float64[*-2]": "dimension 2 takes dimension 1's and 3's path",
    f"{CHAMFER}::test_nearest_matches_dense_float64[*-5]": "dimension 5 takes dimension 3's and 8's path",
    f"{CHAMFER}::test_nearest_matches_dense_float64[*-33]": "dimension 33 takes dimension 15's and 64's path",
    # The heuristic's choice is checked on both sides of its bound (8, 9); past it the heuristic runs the core
    # route, whose own cases follow. The core route (MaxSim's loop on D + 1 features) reads one feature block up
    # to dimension 15: 3, 14 and 15 stay, with 64 past it.
    f"{CHAMFER}::test_nearest_matches_dense_float64[heuristic-2-14]": "the core route: core-*-2-14",
    f"{CHAMFER}::test_nearest_matches_dense_float64[heuristic-2-15]": "the core route: core-*-2-15",
    f"{CHAMFER}::test_nearest_matches_dense_float64[heuristic-2-64]": "the core route: core-*-2-64",
    f"{CHAMFER}::test_nearest_matches_dense_float64[core-*-1]": "one feature block: dimensions 3, 14 and 15",
    f"{CHAMFER}::test_nearest_matches_dense_float64[core-*-8]": "one feature block: dimensions 3, 14 and 15",
    f"{CHAMFER}::test_nearest_matches_dense_float64[core-*-9]": "one feature block: dimensions 3, 14 and 15",
    # MaxSim's kernel (the core routes) keeps MaxSim's tie rule, which tests/ops/maxsim checks; the direct and
    # dot routes keep their own ties here.
    f"{CHAMFER}::test_both_directions_ties_go_to_the_lowest_index[core-*]": "MaxSim's ties, tested there",
    # Two passes of the core route over several blocks: test_nearest_matches_dense_float64[core-*] runs one
    # pass over the same sizes; the small sizes of this test stay in the default run.
    f"{CHAMFER}::test_both_directions_match_dense_float64[core-*-137-70]": "one pass of each: nearest tests",
    f"{CHAMFER}::test_both_directions_match_dense_float64[core-*-7-193]": "one pass of each: nearest tests",
    # 8-bit scoring: each width (16, 40, 128, 300) in the 2-D layout, each layout at width 128 and more.
    f"{QUANTIZED}::test_scores_equal_maxsim_of_dequantized_operands[3d-300-*]": "width 300: the 2d case",
    f"{QUANTIZED}::test_scores_equal_maxsim_of_dequantized_operands[per-query-300-*]": "width 300: the 2d case",
    f"{QUANTIZED}::test_scores_equal_maxsim_of_dequantized_operands[3d-16-*]": "width 16: the 2d, per-query cases",
    f"{QUANTIZED}::test_scores_equal_maxsim_of_dequantized_operands[3d-40-*]": "width 40: the 2d, per-query cases",
    # One document length per tile variant stays: 64 (whole tiles), 96 (the most a narrow tail takes), 20 (a
    # narrow tail alone), 100 and 40 (the clamped loop past and below a tile).
    f"{QUANTIZED}::test_int8_corpus_of_whole_tiles_and_a_narrow_tail[128-*]": "whole tiles: length 64",
    f"{QUANTIZED}::test_int8_corpus_of_whole_tiles_and_a_narrow_tail[70-*]": "a narrow tail: lengths 96 and 20",
    f"{QUANTIZED}::test_one_token_queries_score_bit_for_bit_like_the_reference[*-200]": "widths 64 and 520",
    f"{QUANTIZED}::test_one_token_queries_score_bit_for_bit_like_the_reference[*-300]": "widths 64 and 520",
    # Widths past one feature chunk: 1000, 1024, 2048 and 8192 stay.
    f"{WIDTHS}::test_padded_kernels_match_float64_at_every_width[4096]": "widths 2048 and 8192",
    # Backward routes: every route at every shape with mask_mode="exclude", and with "zero" at shapes 0 and 2.
    f"{BACKWARD}::test_dd_routes[zero-*-shape1]": "every route at shape 1: exclude; zero: shapes 0 and 2",
    f"{BACKWARD}::test_dd_routes[zero-*-shape3]": "every route at shape 3: exclude; zero: shapes 0 and 2",
    # Tiles (entries x documents per dQ program): all four pairs at shapes 0 and 2, the two extremes at 1 and 3.
    f"{BACKWARD}::test_tiles[1-3-shape1]": "1 entry, 3 documents: shapes 0 and 2",
    f"{BACKWARD}::test_tiles[1-3-shape3]": "1 entry, 3 documents: shapes 0 and 2",
    f"{BACKWARD}::test_tiles[4-1-shape1]": "4 entries, 1 document: shapes 0 and 2",
    f"{BACKWARD}::test_tiles[4-1-shape3]": "4 entries, 1 document: shapes 0 and 2",
}


def _collected_whole(config: pytest.Config, path: Path) -> bool:
    """Whether the run asked for all of ``path`` (the file, or a directory above it), not some of its cases."""
    for arg in config.args:
        if "::" in arg:
            continue
        asked = (config.invocation_params.dir / arg).resolve()
        if asked == path or asked in path.parents:
            return True
    return False


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = config.rootpath
    matched = dict.fromkeys(SLOW, False)
    # Brackets in a node id are literal (parameter ids), not fnmatch's character sets; `*` stays a wildcard.
    literal = {p: p.replace("[", "\x00").replace("]", "[]]").replace("\x00", "[[]") for p in SLOW}
    for item in items:
        for pattern in SLOW:
            if fnmatch.fnmatchcase(item.nodeid, literal[pattern]):
                item.add_marker(pytest.mark.slow)
                matched[pattern] = True
    stale = [p for p, hit in matched.items() if not hit and _collected_whole(config, root / p.split("::")[0])]
    if stale and not config.option.keyword and not getattr(config.option, "lf", False):
        raise pytest.UsageError(f"conftest.py's SLOW list names cases that do not exist: {stale}")
