"""engine run's live display: a single prompt streams its text, several prompts get a progress bar."""

from __future__ import annotations

import io

from pagedkv.cli.run_display import _write_new_text, drive
from pagedkv.core.sample.sampling_params import SamplingParams
from pagedkv.testing import tiny_engine


def test_streamed_pieces_add_up_to_the_final_text_and_hold_half_characters():
    sink = io.StringIO()
    shown = ""
    for text, finished in [("안", False), ("안\ufffd", False), ("안녕", False), ("안녕!", True)]:
        shown = _write_new_text(sink, shown, text, finished)
    assert sink.getvalue() == "안녕!\n"  # the half-decoded character was never written


def test_a_stop_string_that_cuts_shown_text_writes_nothing_more():
    sink = io.StringIO()
    shown = _write_new_text(sink, "", "Hello wor", False)
    _write_new_text(sink, shown, "Hello", True)
    assert sink.getvalue() == "Hello wor"


def test_drive_returns_every_finished_request_with_and_without_progress():
    for progress in (False, True):
        engine = tiny_engine(num_blocks=64, block_size=4)
        ids = [engine.add_request([1 + i, 2, 3], SamplingParams(max_tokens=3 + i)) for i in range(4)]
        results = drive(engine, ids, None, progress=progress)
        assert sorted(results) == sorted(ids)
        assert [len(results[i].token_ids) for i in ids] == [3, 4, 5, 6]
        assert engine.pool.num_free == engine.num_blocks
