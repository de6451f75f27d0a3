"""What the scheduler takes out of the prefix cache when it schedules a step, under its asynchronous mode:
every block the step may rewrite, bounded as the worker's own room check bounds a relocation."""

from types import SimpleNamespace

from kvpolicy.config import KVPolicyConfig
from kvpolicy.paging import write_order
from kvpolicy.vllm.scheduler.request_modes import RequestModes
from kvpolicy.vllm.scheduler.rewrite_bounds import RewriteBound
from kvpolicy.vllm.worker.modes import RequestStep

HEADS, LAYERS, BLOCK = 3, 30, 128


def request(prompt: int, computed: int, num_tokens: int | None = None, **extra):
    return SimpleNamespace(
        request_id="r",
        num_prompt_tokens=prompt,
        num_computed_tokens=computed,
        num_tokens=prompt if num_tokens is None else num_tokens,
        sampling_params=SimpleNamespace(extra_args=extra or None),
    )


def bound(**options) -> RewriteBound:
    return RewriteBound(RequestModes(KVPolicyConfig(**options), HEADS, LAYERS, BLOCK))


def test_a_relocation_rewrites_at_most_the_blocks_the_workers_room_check_allows():
    rewrites = bound(policy="adasnap", budget=256)
    order = write_order(17, cached=range(16))  # a 2,100-token prompt in the prefix cache but its last block
    assert order[:3] == [16, 15, 14]
    assert rewrites.positions(request(2100, 1024), 512, order) == []  # a chunk before the last: nothing yet
    # 3 heads x 257 tokens: 7 pages, 3 part-filled ones, in 4 blocks, and a spare block.
    assert rewrites.positions(request(2100, 1536), 564, order) == [16, 15, 14, 13, 12]
    assert rewrites.positions(request(2100, 2100, 2101), 1, order) == [], "relocated once: its blocks left already"


def test_a_request_the_policy_leaves_alone_rewrites_nothing():
    order = write_order(3)
    assert bound(policy="adasnap", budget=512).positions(request(300, 0), 300, order) == []  # under budget
    assert bound(policy="adasnap", budget=128).positions(request(300, 0, kv_policy="none"), 300, order) == []
    assert bound(policy="omnikv", budget=128).positions(request(300, 0), 300, order) == []  # nothing moves


def test_keydiff_rewrites_at_every_chunk_over_budget_and_a_preempted_request_starts_over():
    rewrites = bound(policy="keydiff", budget=128)
    order = write_order(8)
    first = rewrites.positions(request(1000, 0), 256, order)
    assert first and first == order[: len(first)]
    assert rewrites.positions(request(1000, 256), 256, order) == first  # still reading: evicted again
    rewrites.positions(request(1000, 768), 232, order)
    assert "r" in rewrites.done
    rewrites.done.discard("r")  # the connector forgets a preempted request when it is scheduled again
    assert rewrites.positions(request(1000, 0, 1010), 1010, order)  # recomputes prompt and output


def test_a_layout_or_an_offload_rewrites_the_blocks_it_packs_into():
    """What tests/e2e/test_prefix_caching.py measures after a 2,000-token prefix: PoD's layout holds 14 of
    the 17 blocks, OmniKV's offload 7."""
    order = write_order(17, cached=range(16))
    pod = bound(policy="pod", recent_tokens=128, pod_delta=0.5)
    assert pod.positions(request(2100, 0), 2100, order) == order[:14]
    short = bound(policy="pod")  # 1,008 recent tokens: a 1,000-token prompt lays out only once it decodes
    assert short.positions(request(1000, 0), 1000, order) == []
    assert short.positions(request(1000, 1160, 1161), 1, order)
    offload = bound(policy="omnikv", budget=256, offload=1.0)
    assert offload.positions(request(2100, 0), 2100, order) == order[:7]
    assert offload.positions(request(2100, 2100, 2101), 1, order) == [], "a decode row does not offload"


def test_a_new_mode_is_its_class_and_one_registry_line(monkeypatch):
    """The scheduler keeps no rule of a mode's own: a mode registered in ``MODES`` alone is asked, with
    the request as the scheduler sees it, and decides which blocks the step rewrites and when it is done."""
    from kvpolicy.vllm.worker import modes
    from kvpolicy.vllm.worker.modes.base import ModeState, RequestStep

    asked: list[RequestStep] = []

    class EveryOtherBlock(ModeState):
        """A trivial mode: a step that completes the prompt rewrites half its blocks."""

        @staticmethod
        def written_blocks(step: RequestStep) -> int | None:
            asked.append(step)
            return -(-step.end // step.block_size) // 2 if step.complete else None

        def pages_of(self, request):
            return None

        def build(self, batch, shape):
            return None

    trivial = object()  # a mode no policy of the registry runs in
    monkeypatch.setitem(modes.MODES, trivial, modes.ModeKind(EveryOtherBlock, object))
    rewrites = bound(policy="adasnap", budget=128)
    monkeypatch.setattr(rewrites.modes, "policy_of", lambda request: SimpleNamespace(mode=trivial))
    order = write_order(8)
    assert rewrites.positions(request(1000, 0), 512, order) == []  # a chunk: the mode writes nothing
    assert asked[-1].end == 512 and not asked[-1].complete and asked[-1].query_len == 512
    assert rewrites.positions(request(1000, 512), 488, order) == order[:4]
    assert asked[-1].complete and asked[-1].num_kv_heads == HEADS and asked[-1].block_size == BLOCK
    assert "r" in rewrites.done
    assert rewrites.positions(request(1000, 1000, 1001), 1, order) == [], "done: not asked again"
    assert len(asked) == 2


def test_decode_relocates_a_prompt_within_its_budget_once_at_its_first_pass():
    """A 100-token prompt under a 128-token budget (16-token blocks): vLLM's layout until the step that takes
    its cache a page past budget and buffer (the 145th token, which opens a page), then relocated once, choosing
    among every token so far; the scheduler asks no more (later passes rewrite only its own pages)."""
    rewrites = RewriteBound(RequestModes(KVPolicyConfig(policy="adamix", budget=128), HEADS, LAYERS, 16))
    order = write_order(10)
    assert rewrites.positions(request(100, 0), 100, order) == [], "the prompt: within budget"
    assert rewrites.positions(request(100, 140, 141), 1, order) == []
    # Up to 3 heads x 129 tokens, a page each part-filled, and a spare block: every block of the 145 tokens.
    assert rewrites.positions(request(100, 144, 145), 1, order) == order
    assert "r" in rewrites.done
    assert rewrites.positions(request(100, 160, 161), 1, order) == [], "relocated once: its blocks left already"
    rewrites.done.discard("r")  # preempted: recomputed in vLLM's layout, relocated again at a pass
    assert rewrites.positions(request(100, 0, 170), 170, order) == []
    assert rewrites.positions(request(100, 176, 177), 1, write_order(12)) == write_order(12)[:11]
    off = RewriteBound(RequestModes(KVPolicyConfig(policy="adamix", budget=128, decode_buffer=0), HEADS, LAYERS, 16))
    assert off.positions(request(100, 144, 145), 1, order) == []
    assert rewrites.positions(request(100, 144, 145, kv_decode_buffer=0), 1, order) == []
    assert rewrites.positions(request(100, 144, 145, kv_policy="none"), 1, order) == []


def test_the_decode_passes_of_each_policy():
    """The SnapKV family and streaming pass a page past budget and buffer, then every buffer (in whole pages);
    the evicting policies relocate a page past the budget and evict on their own from there."""
    from kvpolicy.vllm.worker.modes.relocate import Relocate

    def passes(policy, prompt=100, buffer=None, **options):
        config = KVPolicyConfig(policy=policy, budget=128, **options)
        step = RequestStep(
            config.make_policy(), config, prompt, prompt, prompt, prompt, None, HEADS, LAYERS, 16, buffer
        )
        return Relocate.decode_passes(step)

    adamix = passes("adamix")
    assert (adamix.budget, adamix.first, adamix.period, adamix.window, adamix.repeats) == (128, 145, 16, 16, True)
    assert [end for end in range(100, 200) if adamix.due(end)] == [145, 161, 177, 193]
    assert [end for end in range(130, 162) if adamix.observes(end)] == [*range(130, 145), *range(146, 161)]
    assert adamix.kept_queries == 0
    snapkv = passes("snapkv", buffer=40)  # a 48-token period; the 32-query window fits in it
    assert (snapkv.first, snapkv.period, snapkv.kept_queries) == (177, 48, 0)
    assert passes("snapkv", buffer=8).kept_queries == 16, "a window longer than the period keeps the rest"
    assert passes("streaming").window == 0
    h2o = passes("h2o")
    assert (h2o.first, h2o.window, h2o.repeats) == (144, 16, False), "the queries since the budget score it"
    assert passes("keydiff").window == 0
    assert passes("adamix", prompt=300) is None, "a long prompt is compressed at its end"
    assert passes("adamix", buffer=0) is None
    assert passes("adamix", decode_buffer=0) is None


def test_decode_passes_keep_the_same_count_in_every_head():
    """Ada-KV's head allocation is left to prompts: a pass in decode reads every head of a layer as one tensor;
    so are D2O's inverse-variance layer budgets, which the few queries of a pass in decode skew."""
    from kvpolicy.policies.compose import UniformHeads
    from kvpolicy.vllm.worker.modes.decode_passes import decode_form

    adamix = KVPolicyConfig(policy="adamix", budget=128).make_policy()
    uniform = decode_form(adamix)
    assert isinstance(uniform.heads, UniformHeads) and not isinstance(adamix.heads, UniformHeads)
    assert uniform.scorer == adamix.scorer and uniform.window == adamix.window == 16
    assert decode_form(adamix) is uniform, "made once"
    snapkv = KVPolicyConfig(policy="snapkv", budget=128).make_policy()
    assert decode_form(snapkv) is snapkv
    d2o = decode_form(KVPolicyConfig(policy="d2o", budget=128).make_policy())
    assert d2o.layer_budgets([None] * 3, 128) == [128] * 3, "D2O's layer budgets are left to prompts too"


def test_the_scheduler_reserves_by_the_modes_decode_passes():
    """The connector's admission asks the request's mode when decode compresses it (``ModeState.decode_passes``),
    the rule the worker's passes run by: the blocks vLLM has given it by its first pass, and those it appends
    between two; nothing for a request that runs stock or a mode that never compresses in decode."""
    modes = RequestModes(KVPolicyConfig(policy="adamix", budget=128), HEADS, LAYERS, 16)
    adamix = modes.decode_passes(request(100, 0))
    assert adamix.first == 145 and adamix.blocks_at_first_pass(250, 16) == 10 == -(-145 // 16)
    assert adamix.blocks_at_first_pass(120, 16) == 8, "a request that ends before its first pass"
    assert adamix.blocks_between_passes(16) == 2
    assert modes.decode_passes(request(100, 0, kv_policy="none")) is None
    assert modes.decode_passes(request(300, 0)) is None, "a long prompt is compressed at its end"
    keydiff = RequestModes(KVPolicyConfig(policy="keydiff", budget=128, decode_buffer=64), HEADS, LAYERS, 16)
    assert keydiff.decode_passes(request(100, 0)).blocks_at_first_pass(250, 16) == 9, "a page past the budget"
    omnikv = RequestModes(KVPolicyConfig(policy="omnikv", budget=128), HEADS, LAYERS, 16)
    assert omnikv.decode_passes(request(100, 0)) is None
