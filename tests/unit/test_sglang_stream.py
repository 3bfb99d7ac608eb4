"""The SGLang adapter reads generate_answers' stream in work linear in each answer's length: SGLang streams
incrementally (each chunk only what is new) and the adapter appends each chunk's new part (no SGLang needed:
the chunks are built as SGLang 0.5's tokenizer manager sends them)."""

from dapo_mcore.rollout.base import EngineSettings
from dapo_mcore.rollout.sglang_engine import StreamedAnswers, _engine_kwargs


class CountedList(list):
    """A chunk's list that counts the elements read out of it (indexing, slicing, iterating)."""

    def __init__(self, items, reads: list[int]):
        super().__init__(items)
        self.reads = reads

    def __getitem__(self, key):
        got = super().__getitem__(key)
        self.reads[0] += len(got) if isinstance(key, slice) else 1
        return got

    def __iter__(self):
        for item in super().__iter__():
            self.reads[0] += 1
            yield item


def token(position: int) -> int:
    return 3 + position % 90


def logprob(position: int) -> float:
    return -0.001 * position


def chunk(index: int, tokens: list[int], logprobs: list[float], total: int, reads: list[int], finish=None) -> dict:
    """One chunk of SGLang's incremental stream: the new tokens, their log-probs as (logprob, token id, text;
    the adapter reads the log-prob only), and the request's total so far (meta_info's completion_tokens)."""
    entries = [(lp, 0, None) for lp in logprobs]
    meta = {"finish_reason": finish, "completion_tokens": total, "output_token_logprobs": CountedList(entries, reads)}
    return {"index": index, "output_ids": CountedList(tokens, reads), "meta_info": meta}


def streamed(n_tokens: int) -> tuple[StreamedAnswers, int]:
    """One answer of n_tokens streamed a token per chunk (stream_interval 1); the elements the adapter read."""
    reads = [0]
    answers = StreamedAnswers(1)
    for k in range(n_tokens):
        finish = {"type": "length"} if k == n_tokens - 1 else None
        answers.add(chunk(0, [token(k)], [logprob(k)], k + 1, reads, finish))
    return answers, reads[0]


def test_reading_a_streamed_answer_is_linear_in_its_length():
    short, short_reads = streamed(1000)
    long, long_reads = streamed(4000)
    assert long.tokens[0] == [token(k) for k in range(4000)]
    assert long.logprobs[0] == [logprob(k) for k in range(4000)]
    # each token and log-prob read once: 4x the tokens, 4x the work (the cumulative stream read was ~16x)
    assert long_reads == 2 * 4000
    assert long_reads / short_reads < 5


def test_the_last_chunk_of_a_request_aborted_while_waiting_adds_nothing():
    # SGLang's _handle_abort_req under incremental streaming: output_ids is the last token again and the
    # log-probs are all of them; completion_tokens says nothing is new.
    reads = [0]
    answers = StreamedAnswers(1)
    answers.add(chunk(0, [7, 8, 9], [-0.1, -0.2, -0.3], 3, reads))
    answers.add(chunk(0, [9], [-0.1, -0.2, -0.3], 3, reads, finish={"type": "abort"}))
    assert answers.tokens[0] == [7, 8, 9]
    assert answers.logprobs[0] == [-0.1, -0.2, -0.3]


def test_a_log_prob_sent_ahead_of_its_token_is_taken_once():
    # a chunk's log-probs are sliced from the tokens sent before, and may hold one past its tokens
    reads = [0]
    answers = StreamedAnswers(1)
    answers.add(chunk(0, [7], [-0.1, -0.2], 1, reads))
    answers.add(chunk(0, [8, 9], [-0.2, -0.3], 3, reads, finish={"type": "stop"}))
    assert answers.tokens[0] == [7, 8, 9]
    assert answers.logprobs[0] == [-0.1, -0.2, -0.3]


def test_chunks_of_several_requests_interleaved_grow_each_request_apart():
    reads = [0]
    answers = StreamedAnswers(2)
    answers.add(chunk(1, [5], [-0.5], 1, reads))
    assert answers.add(chunk(0, [7, 8], [-0.1, -0.2], 2, reads)) == 0  # two chunks queued, joined into one
    assert answers.add(chunk(1, [6], [-0.6], 2, reads, finish={"type": "stop"})) == 1
    assert answers.tokens == [[7, 8], [5, 6]]
    assert answers.logprobs == [[-0.1, -0.2], [-0.5, -0.6]]


def test_the_engine_is_started_with_incremental_streaming():
    assert _engine_kwargs(EngineSettings(model_path="m", device="cuda"))["incremental_streaming_output"] is True
