"""A request's grammar state goes when the request ends (issue 42, RSS kept after big-grammar): nothing in the
engine keeps a finished (or aborted) sequence's matcher alive, so once the compiled-grammar cache evicts a
grammar its memory can go back, even on a server that receives nothing more."""

from __future__ import annotations

import gc
import weakref

from pagedkv.core.config import EngineConfig
from pagedkv.core.engine import Engine
from pagedkv.core.hookspecs import hookimpl
from pagedkv.core.sample.sampling_params import SamplingParams
from pagedkv.core.sample.structured_output import StructuredOutputs
from pagedkv.testing import BYTE_VOCAB, byte_tokenizer, tiny_llama


class WatchedMatchers:
    """llguidance, with every matcher handed out (and every compiled grammar) watched through a weakref."""

    def __init__(self) -> None:
        self.matchers: list[weakref.ref] = []
        self.grammars: list[weakref.ref] = []

    @hookimpl
    def pagedkv_register_grammar_backends(self, register):
        from pagedkv.plugins.llguidance_backend import GuidanceBackend, GuidanceGrammar, GuidanceMatcher

        outer = self

        class Matcher(GuidanceMatcher):
            __slots__ = ("__weakref__",)

            def copy(self):
                twin = Matcher(self.inner.deep_copy())
                outer.matchers.append(weakref.ref(twin))
                return twin

        class Grammar(GuidanceGrammar):
            def matcher(self):
                m = Matcher(super().matcher().inner)
                outer.matchers.append(weakref.ref(m))
                return m

        class Backend(GuidanceBackend):
            def compile(self, constraint):
                grammar = Grammar(super().compile(constraint)._start)
                outer.grammars.append(weakref.ref(grammar))
                return grammar

        register("watched", Backend, "llguidance, watched")

    def alive(self) -> tuple[int, int]:
        gc.collect()
        return sum(r() is not None for r in self.matchers), sum(r() is not None for r in self.grammars)


def watched_engine(plugin: WatchedMatchers, **config) -> Engine:
    return Engine(EngineConfig(device="cpu", num_blocks=256, block_size=8, structured_outputs_backend="watched",
                               **config),
                  model=tiny_llama(vocab_size=BYTE_VOCAB, num_hidden_layers=1), tokenizer=byte_tokenizer(),
                  plugins=(plugin,))


def constrained(regex: str, n: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=12, n=n, temperature=1.0, seed=1, structured=StructuredOutputs(regex=regex))


def run_out(engine: Engine) -> None:
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        assert steps < 2000


def test_a_finished_requests_matchers_are_released_without_another_step():
    plugin = WatchedMatchers()
    engine = watched_engine(plugin)
    engine.add_request("x", constrained("[a-z]{4,8}", n=2), request_id="a")
    run_out(engine)
    assert plugin.matchers and plugin.alive()[0] == 0  # no matcher of the finished request is left anywhere
    assert engine.pool.num_used == 0
    engine.close()


def test_an_aborted_requests_matchers_are_released_at_once():
    plugin = WatchedMatchers()
    engine = watched_engine(plugin)
    engine.add_request("x", constrained("[a-z]{40,80}"), request_id="a")
    while not any(r() is not None for r in plugin.matchers):  # decoding under its grammar
        engine.step()
    engine.step()
    assert engine.abort("a")
    assert plugin.alive()[0] == 0
    assert engine.pool.num_used == 0
    engine.close()


def test_an_evicted_grammar_is_freed_once_its_requests_end():
    plugin = WatchedMatchers()
    engine = watched_engine(plugin, grammar_cache_bytes=300 * 1024)  # room for one small grammar (256 KiB + ...)
    engine.add_request("x", constrained("[a-z]{4,8}"), request_id="a")
    run_out(engine)
    engine.check_structured(StructuredOutputs(regex="[0-9]{4,8}"))  # evicts the first one
    assert plugin.alive() == (0, 1)  # only the newest, cached grammar remains
    engine.close()
