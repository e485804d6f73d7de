"""Stop strings over arbitrary texts cut into arbitrary tokens (property-based): what is
streamed is always a prefix of the final text (nothing is ever taken back, so a stop
string or anything after it can never have been sent), and the final text is cut exactly
at the earliest stop of the first token that completes one."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from tessera.engine.output_processor import OutputProcessor
from tessera.engine.sequence import Sequence
from tessera.sampling import SamplingParams


class PieceTokenizer:
    """Token i decodes to pieces[i]; decoding concatenates (no merges, no specials)."""

    def __init__(self, pieces: list[str]):
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(self.pieces[i] for i in ids)

    def batch_decode(self, batch, skip_special_tokens: bool = True) -> list[str]:
        return [self.decode(ids) for ids in batch]


alphabet = st.sampled_from("ab c")
pieces_strategy = st.lists(st.text(alphabet, min_size=1, max_size=4), min_size=1, max_size=25)
stops_strategy = st.lists(st.text(alphabet, min_size=1, max_size=4), min_size=1, max_size=3)


def reference(pieces: list[str], stops: list[str], include: bool) -> tuple[str, str | None]:
    text = ""
    for piece in pieces:
        text += piece
        hits = [(text.find(s), -len(s), s) for s in stops if s in text]
        if hits:
            start, _, stop = min(hits)
            return text[:start + (len(stop) if include else 0)], stop
    return text, None


@settings(max_examples=400, deadline=None)
@given(pieces=pieces_strategy, stops=stops_strategy, include=st.booleans())
def test_streamed_text_is_always_a_prefix_of_the_final_text(pieces, stops, include):
    tokenizer = PieceTokenizer(["<p>"] + pieces)
    ids = list(range(1, len(pieces) + 1))
    params = SamplingParams(max_new_tokens=len(ids), ignore_eos=True, stop=stops,
                            include_stop_str_in_output=include)
    seq = Sequence("r", None, [0], params, 10_000)
    processor = OutputProcessor(tokenizer, frozenset())
    streamed = []
    for token in ids:
        delta, _ = processor.append_token(seq, token, None)
        streamed.append(delta)
        if seq.finish_reason is not None:
            break
    expected, stop = reference(pieces, stops, include)
    final = seq.output_text
    assert final == expected
    assert "".join(streamed) == final
    assert seq.stop_reason == stop
    assert seq.finish_reason.value == ("length" if stop is None else "stop_sequence")
    sent = ""
    for delta in streamed:
        sent += delta
        assert final.startswith(sent)
        if not include:
            assert not any(s in sent for s in stops)
