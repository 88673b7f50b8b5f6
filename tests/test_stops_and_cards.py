"""Stop strings over streamed text, and the custom-card folder kept equal to State."""

from pathlib import Path

import pytest

from exo.core.types import ModelCard, SamplingDefaults
from exo.models.cards import CardError, card_file_name, load_builtin_cards, read_card, reconcile_custom_cards
from exo.resources import builtin_cards_dir
from exo.runner.stops import StopMatcher


def stream(matcher: StopMatcher, pieces: list[str]) -> str:
    return "".join(matcher.feed(p) for p in pieces) + matcher.flush()


def test_stop_string_split_across_pieces_is_cut_and_nothing_after_it_is_emitted():
    matcher = StopMatcher(["END"])
    assert stream(matcher, ["hello E", "N", "D and more"]) == "hello "
    assert matcher.stopped


def test_a_partial_match_that_does_not_complete_is_emitted():
    matcher = StopMatcher(["END"])
    assert matcher.feed("the EN") == "the "
    assert matcher.feed("d") == "ENd"
    assert stream(StopMatcher(["END"]), ["tail E"]) == "tail E" and not StopMatcher(["END"]).stopped


def test_earliest_of_several_stops_wins_and_no_stops_is_passthrough():
    assert stream(StopMatcher(["b", "xyz"]), ["axyzb"]) == "a"
    assert stream(StopMatcher([]), ["a", "b"]) == "ab"


def test_builtin_cards_are_valid():
    cards = load_builtin_cards(builtin_cards_dir())
    assert len(cards) >= 3
    assert all(c.n_layers > 0 and c.storage_bytes > 0 for c in cards.values())


def test_cards_reject_unknown_fields_and_path_tricks(tmp_path: Path):
    (tmp_path / "typo.toml").write_text('model_id = "a/b"\nn_layer = 3\n')
    with pytest.raises(CardError, match="n_layer"):
        read_card(tmp_path / "typo.toml")
    for bad in ("../x", "/etc/passwd", "a/../../b", "a/b/c", ""):
        with pytest.raises(CardError):
            card_file_name(bad)


def test_reconcile_writes_changes_and_deletes_what_state_no_longer_has(tmp_path: Path):
    folder = tmp_path / "custom"
    a = ModelCard(model_id="org/a", n_layers=2, sampling=SamplingDefaults(temperature=0.5))
    b = ModelCard(model_id="org/b", n_layers=3)
    reconcile_custom_cards(folder, {"org/a": a, "org/b": b})
    assert sorted(p.name for p in folder.iterdir()) == ["org--a.toml", "org--b.toml"]
    assert read_card(folder / "org--a.toml") == a
    changed = ModelCard(model_id="org/a", n_layers=4)
    reconcile_custom_cards(folder, {"org/a": changed})
    assert sorted(p.name for p in folder.iterdir()) == ["org--a.toml"]
    assert read_card(folder / "org--a.toml") == changed


def test_coalescer_sends_the_first_text_at_once_and_batches_fast_text():
    from exo.runner.coalesce import Coalescer

    coalescer = Coalescer(interval=0.020)
    assert coalescer.add("a", now=1.000) == ("a", "")  # nothing sent recently: no wait
    assert coalescer.add("b", now=1.005) is None
    assert coalescer.add("c", now=1.010) is None
    assert coalescer.add("d", now=1.021) == ("bcd", "")
    assert coalescer.add("e", now=1.050) == ("e", "")  # slow text streams token by token
    assert coalescer.add("f", now=1.055) is None
    assert coalescer.flush(now=1.056) == ("f", "") and coalescer.flush(now=1.057) is None


def test_coalescer_never_puts_content_before_reasoning_that_came_after_it():
    from exo.runner.coalesce import Coalescer

    coalescer = Coalescer(interval=0.020)
    assert coalescer.add("", now=1.000, reasoning="r1") == ("", "r1")
    assert coalescer.add("", now=1.005, reasoning="r2") is None
    assert coalescer.add("c1", now=1.010) is None  # reasoning then content: one chunk, in that order
    assert coalescer.add("", now=1.012, reasoning="r3") == ("c1", "r2")  # ...but content held before reasoning leaves first
    assert coalescer.flush(now=1.013) == ("", "r3")
    # A step with both (the thinking ends, the answer begins) while content is held: nothing is dropped.
    assert coalescer.add("c2", now=1.014) is None
    assert coalescer.add("c3", now=1.015, reasoning="r4") == ("c2", "")
    assert coalescer.flush(now=1.016) == ("c3", "r4")
