"""A torchrun job's lines as its workers printed them (agent.running.RankedLines). torchrun copies
each worker's output from a file a line at a time, marked "[rankN]:"; a line a worker wrote in
pieces (print's arguments under `python -u`, as every job runs) was copied in pieces when the copy
caught up with the writer, glued to the other workers' output: CI saw a torchrun job's
"sum 3 interfaces 1" stored as " 3 interfaces 1"."""

import pytest

from agent.running import RankedLines

pytestmark = pytest.mark.nodb


def fed(*stream, limit=1000):
    ranked = RankedLines(limit)
    lines = [line for text in stream for line in ranked.feed(text)]
    return lines + ranked.rest()


def test_whole_lines_lose_their_marks_and_keep_their_ranks():
    assert fed("[rank0]:step 1", "[rank1]:step 1", "[rank0]:") == [(0, "step 1"), (1, "step 1"), (0, "")]


def test_pieces_of_lines_copied_before_their_end_are_rejoined_per_worker():
    # What CI's run read: each worker's "sum" copied before the rest of its line.
    assert fed("[rank0]:sum[rank1]:sum[rank0]: 3 interfaces 1", "[rank1]: 3 interfaces 1") == [
        (0, "sum 3 interfaces 1"),
        (1, "sum 3 interfaces 1"),
    ]
    # A piece, then another worker's whole line, then the rest.
    assert fed("[rank0]:epoch[rank1]:ready", "[rank0]: 2 of 3") == [(1, "ready"), (0, "epoch 2 of 3")]
    # In three pieces.
    assert fed("[rank2]:a[rank2]:b[rank2]:c") == [(2, "abc")]


def test_a_mark_in_the_workers_own_text_stays_in_it():
    # PyTorch's own warnings are marked with the rank already: torchrun marks them again.
    assert fed("[rank0]:[rank0]:[W1207 socket.cpp:207] a warning") == [(0, "[rank0]:[W1207 socket.cpp:207] a warning")]


def test_lines_without_a_mark_are_taken_whole():
    assert fed("torchrun: starting", "W1207 [rank0]: not at the start") == [(None, "torchrun: starting"), (None, "W1207 [rank0]: not at the start")]


def test_a_line_never_ended_is_kept_when_the_stream_closes():
    assert fed("[rank0]:done[rank1]:last words") == [(1, "last words"), (0, "done")]


def test_a_start_held_past_the_line_limit_goes_out_as_a_line_of_its_own():
    assert fed("[rank0]:" + "x" * 6 + "[rank1]:y", "[rank0]:" + "x" * 6 + "[rank0]:z", limit=10) == [(1, "y"), (0, "x" * 12), (0, "z")]
