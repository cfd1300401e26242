"""The mixture-of-experts feed-forward network (`model.moe_experts`, transformer/moe.py) against an
explicit loop over tokens: routing, combination weights, capacity drops, the load-balancing loss and
its gradient."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from transformer.config import ConfigError, ModelConfig
from transformer.model import Transformer
from transformer.moe import MixtureOfExperts, Routing, load_balancing_loss
from transformer.training.loss import Seq2SeqLoss

D_MODEL, D_FF = 8, 16


def ffn(expert, x):
    """max(0, x W_1 + b_1) W_2 + b_2 (Eq. 2) in float64, written out."""
    w_1, b_1 = expert.w_1.weight.double(), expert.w_1.bias.double()
    w_2, b_2 = expert.w_2.weight.double(), expert.w_2.bias.double()
    return torch.clamp(x @ w_1.T + b_1, min=0) @ w_2.T + b_2


def reference(moe: MixtureOfExperts, x: torch.Tensor, capacity: int | None, real: torch.Tensor | None = None):
    """One token at a time: each token's k best experts; the first choices of all tokens claim places
    before any second choice; an expert past `capacity` drops the assignment. Padding (`real` False)
    is skipped: no place, no output, no share of f_e and P_e."""
    tokens = x.reshape(-1, x.size(-1)).double()
    n, n_experts, k = tokens.size(0), len(moe.experts), moe.top_k
    counted = list(range(n)) if real is None else [t for t, r in enumerate(real.reshape(-1).tolist()) if r]
    logits = tokens @ moe.router.weight.double().T
    probs = [[math.exp(v) / sum(math.exp(u) for u in row) for v in row] for row in logits.tolist()]
    ranked = [sorted(range(n_experts), key=lambda e, p=p: -p[e])[:k] for p in probs]
    load, dropped = [0] * n_experts, 0
    out = torch.zeros_like(tokens)
    for choice in range(k):
        for t in counted:
            e = ranked[t][choice]
            total = sum(probs[t][c] for c in ranked[t])
            weight = probs[t][e] / total if k > 1 else probs[t][e]
            if capacity is not None and load[e] >= capacity:
                dropped += 1
                continue
            load[e] += 1
            out[t] += weight * ffn(moe.experts[e], tokens[t])
    first = [sum(ranked[t][0] == e for t in counted) / len(counted) for e in range(n_experts)]
    mean_prob = [sum(probs[t][e] for t in counted) / len(counted) for e in range(n_experts)]
    aux = n_experts * sum(f * p for f, p in zip(first, mean_prob))
    return out.view(x.shape), dropped, aux, probs, first


def mixture(experts=4, top_k=2, capacity=1.0, seed=0):
    torch.manual_seed(seed)
    moe = MixtureOfExperts(D_MODEL, D_FF, experts, top_k, capacity)
    with torch.no_grad():  # a sharper router than its init, so that the load is uneven and capacity bites
        moe.router.weight.mul_(3)
    return moe, torch.randn(3, 7, D_MODEL)


@pytest.mark.parametrize("experts, top_k, capacity", [(4, 2, 1.0), (4, 1, 1.0), (3, 2, 0.5), (4, 2, 4.0)])
def test_training_forward_routes_combines_and_drops_as_the_token_loop(experts, top_k, capacity):
    moe, x = mixture(experts, top_k, capacity)
    out, stats = moe.route(x, None)
    limit = math.ceil(capacity * x.shape[0] * x.shape[1] * top_k / experts)
    expected, dropped, aux, _, _ = reference(moe, x, limit)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    assert stats.dropped.item() == dropped and stats.assignments.item() == 21 * top_k
    assert (dropped > 0) == (capacity < 4.0)  # the small capacities drop, the large one never does
    assert stats.loss.item() == pytest.approx(aux, rel=1e-5)


def test_padding_takes_no_place_and_no_share_of_the_load():
    """Padded positions get no expert and add nothing; the capacity is reckoned on the 13 real tokens."""
    moe, x = mixture(capacity=0.5)
    real = torch.ones(3, 7, dtype=torch.bool)
    real[0, 4:], real[2, 2:] = False, False  # 13 real tokens of 21
    out, stats = moe.route(x, real)
    expected, dropped, aux, _, _ = reference(moe, x, math.ceil(0.5 * 13 * 2 / 4), real)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    assert out[~real].abs().max() == 0
    assert stats.dropped.item() == dropped and stats.assignments.item() == 13 * 2
    assert stats.loss.item() == pytest.approx(aux, rel=1e-5)


def test_in_the_model_extra_padding_changes_neither_the_routing_nor_the_objective():
    """The objective shows each stack's padding to its mixtures: padding a batch further leaves the
    training loss, load-balancing term and capacity drops included, as it was; in a copy of the model,
    in eager mode and compiled."""
    cfg = ModelConfig(
        vocab_size=50,
        d_model=16,
        n_heads=2,
        d_ff=32,
        n_layers=2,
        dropout=0.0,
        moe_experts=4,
        moe_capacity=0.5,
    )
    torch.manual_seed(0)
    src, tgt = torch.randint(4, 50, (2, 5)), torch.randint(4, 50, (2, 6))
    src[1, 3:], tgt[1, 4:] = 0, 0
    padded = F.pad(src, (0, 3)), F.pad(tgt, (0, 2)), F.pad(tgt, (0, 2))
    model = copy.deepcopy(Transformer(cfg)).train()

    def stats(src, tgt):  # each layer's routing, as the objective asks for it
        routed = []
        memory = model.encode(src, model.src_mask(src), Routing(src != 0, routed))
        model.decode(tgt, memory, model.src_mask(src), routing=Routing(tgt != 0, routed))
        return [(s.assignments.item(), s.dropped.item()) for s in routed]

    assert [a for a, _ in stats(src, tgt)] == [8 * 2] * 2 + [10 * 2] * 2  # real tokens x top_k
    assert sum(d for _, d in stats(src, tgt)) > 0 and stats(*padded[:2]) == stats(
        src, tgt
    )  # the capacity binds
    for objective in (
        Seq2SeqLoss(model, 0.1).train(),
        torch.compile(Seq2SeqLoss(model, 0.1).train(), backend="aot_eager"),
    ):
        loss, _, figures = objective(src, tgt, tgt)
        assert figures["moe_dropped"].item() > 0
        longer, _, longer_figures = objective(*padded)
        assert longer.item() == pytest.approx(loss.item(), rel=1e-5)
        assert longer_figures["moe_dropped"].item() == figures["moe_dropped"].item()


def test_decoding_has_no_capacity_so_a_token_never_depends_on_its_batch():
    moe, x = mixture(capacity=0.25)
    moe.eval()
    expected, _, _, _, _ = reference(moe, x, capacity=None)
    torch.testing.assert_close(moe(x).double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(moe(x[1:2]), moe(x)[1:2])


def test_the_load_balancing_gradient_is_the_formula():
    """d aux / d logit_{t,j} = (E / N) sum_e f_e p_{t,e} (delta_ej - p_{t,j}); f_e is a count, no
    gradient; d aux / d W_r = sum_t (d aux / d logit_t) x_t^T."""
    moe, x = mixture()
    moe.route(x, None)[1].loss.backward()
    _, _, _, probs, first = reference(moe, x, capacity=None)
    p, f = torch.tensor(probs, dtype=torch.float64), torch.tensor(first, dtype=torch.float64)
    n, n_experts = p.shape
    d_logits = n_experts / n * ((f * p).sum(-1, keepdim=True) * -p + f * p)  # (N, E)
    expected = d_logits.T @ x.reshape(-1, D_MODEL).double()  # (E, d_model)
    torch.testing.assert_close(moe.router.weight.grad.double(), expected, atol=1e-6, rtol=1e-5)


def test_an_even_load_scores_one_and_the_objective_adds_the_weighted_sum_over_layers():
    moe, x = mixture(experts=2, top_k=1)
    with torch.no_grad():
        moe.router.weight.zero_()  # every probability 1/2: f and P even whatever the ties
    assert moe.route(x, None)[1].loss.item() == pytest.approx(1.0)

    # capacity for every assignment, so that training and validation route alike
    cfg = dict(vocab_size=50, d_model=16, n_heads=2, d_ff=32, n_layers=2, dropout=0.0)
    cfg.update(moe_experts=4, moe_capacity=2)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**cfg, moe_aux_loss=0.0))
    src, tgt = torch.randint(4, 50, (2, 5)), torch.randint(4, 50, (2, 6))
    tgt[1, 4:] = 0  # padding targets do not count
    plain, nll, _ = Seq2SeqLoss(model, 0.1).train()(src, tgt, tgt)
    routed = []
    memory = model.encode(src, model.src_mask(src), Routing(src != 0, routed))
    model.decode(tgt, memory, model.src_mask(src), routing=Routing(tgt != 0, routed))
    aux = load_balancing_loss(routed)
    assert len(routed) == 4 and aux.item() == pytest.approx(sum(s.loss.item() for s in routed))
    model.cfg.moe_aux_loss = 0.5
    weighted, _, _ = Seq2SeqLoss(model, 0.1).train()(src, tgt, tgt)
    assert weighted.item() == pytest.approx(plain.item() + 0.5 * aux.item() * 10, rel=1e-6)
    evaluated, eval_nll, figures = Seq2SeqLoss(model, 0.1).eval()(
        src, tgt, tgt
    )  # validation: no auxiliary term
    assert figures == {}
    assert evaluated.item() == pytest.approx(plain.item(), rel=1e-6)
    assert eval_nll.item() == pytest.approx(nll.item(), rel=1e-6)


@pytest.mark.parametrize(
    "override, message",
    [
        ({"moe_experts": 1}, "model.moe_experts=1 must be 0 (dense) or at least 2"),
        ({"moe_experts": 4, "moe_top_k": 5}, "model.moe_top_k=5 must be between 1 and model.moe_experts=4"),
        ({"moe_experts": 4, "moe_capacity": 0}, "model.moe_capacity=0.0 must be positive"),
        ({"moe_experts": 4, "moe_aux_loss": -1}, "model.moe_aux_loss=-1.0 must be >= 0"),
    ],
)
def test_bad_mixture_settings_are_named(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ModelConfig(**override)
