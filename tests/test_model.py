"""The model against the paper's definitions, computed independently (float64, CPU)."""

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import sdpa_calls

from transformer.attention import MultiHeadAttention
from transformer.checkpoint import current_names
from transformer.config import ConfigError, ModelConfig
from transformer.inference.visualize import recording
from transformer.layers import EncoderLayer, sinusoidal_table
from transformer.model import Transformer

PAD = 0


def tiny(**overrides) -> Transformer:
    cfg = dict(vocab_size=40, d_model=32, n_heads=4, d_ff=64, n_layers=2, dropout=0.0)
    torch.manual_seed(0)
    return Transformer(ModelConfig(**{**cfg, **overrides})).double().eval()


def batch(b: int = 3, s: int = 7, t: int = 6, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, 40, (b, s), generator=g)
    src[0, 4:] = PAD  # a padded source row
    src[2, 6:] = PAD
    tgt = torch.randint(4, 40, (b, t), generator=g)
    return src, tgt


def explicit_attention(x_q, x_kv, w_q, w_k, w_v, w_o, n_heads, n_kv_heads, mask):
    """Eq. (1) and the multi-head concatenation, head by head, with plain loops."""
    d_k = w_q.shape[0] // n_heads
    d_v = w_v.shape[0] // n_kv_heads
    group = n_heads // n_kv_heads
    heads = []
    for h in range(n_heads):
        g = h // group  # the key/value head this query head shares
        q = x_q @ w_q[h * d_k : (h + 1) * d_k].T
        k = x_kv @ w_k[g * d_k : (g + 1) * d_k].T
        v = x_kv @ w_v[g * d_v : (g + 1) * d_v].T
        scores = q @ k.transpose(-2, -1) / math.sqrt(d_k)
        scores = scores.masked_fill(~mask, float("-inf"))
        heads.append(torch.softmax(scores, dim=-1) @ v)
    return torch.cat(heads, dim=-1) @ w_o.T


def attention_module(kind: str, n_kv_heads: int) -> MultiHeadAttention:
    torch.manual_seed(0)
    attn = MultiHeadAttention(
        32, 4, 8, 8, n_kv_heads, 0.0, cross=kind == "cross", causal=kind == "decoder_self"
    )
    attn.reset_parameters()
    return attn.double().eval()


def attention_inputs(kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x (2, 5, 32), memory (2, 7, 32) and the key mask (the second row's last two keys padding)."""
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    memory = torch.randn(2, 7, 32, dtype=torch.float64)
    key_mask = torch.ones(2, 7 if kind == "cross" else 5, dtype=torch.bool)
    key_mask[1, -2:] = False
    return x, memory, None if kind == "decoder_self" else key_mask


@pytest.mark.parametrize("kind", ["encoder_self", "decoder_self", "cross"])
@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_fused_and_written_out_attention_match_explicit_math(kind, n_kv_heads):
    attn = attention_module(kind, n_kv_heads)
    x, memory, key_mask = attention_inputs(kind)
    if kind == "cross":
        w_q, (w_k, w_v) = attn.w_q.weight, attn.w_kv.weight.split(attn.splits[1:])
        kv_in, mask = memory, key_mask[:, None, :]
    else:
        w_q, w_k, w_v = attn.w_qkv.weight.split(attn.splits)
        kv_in = x
        mask = (
            torch.ones(5, 5, dtype=torch.bool).tril()[None] if kind == "decoder_self" else key_mask[:, None]
        )
    expected = explicit_attention(x, kv_in, w_q, w_k, w_v, attn.w_o.weight, 4, n_kv_heads, mask)
    torch.testing.assert_close(attn(x, memory, key_mask), expected, rtol=1e-10, atol=1e-12)  # fused
    recorder, records = recording(attn)
    reference = recorder(x, memory, key_mask)
    assert (
        len(records) == 1 and records[0].kind == kind and records[0].weights.shape == (2, 4, 5, mask.size(-1))
    )
    torch.testing.assert_close(reference, expected, rtol=1e-10, atol=1e-12)
    assert type(attn) is MultiHeadAttention  # the module itself is untouched


def test_whole_model_fused_equals_written_out_attention(monkeypatch):
    model = tiny(n_kv_heads=2)
    src, tgt = batch()
    with sdpa_calls(monkeypatch) as calls:
        fast = model(src, tgt)
    assert len(calls) == 6  # 2 encoder and 2 x 2 decoder layers
    recorder, records = recording(model)
    reference = recorder(src, tgt)
    kinds = sorted({(r.kind, r.layer) for r in records})
    assert kinds == sorted((k, i) for k in ("encoder_self", "decoder_self", "cross") for i in range(2))
    torch.testing.assert_close(fast, reference, rtol=1e-10, atol=1e-10)


def test_causal_mask_future_targets_never_change_earlier_outputs():
    model = tiny()
    src, tgt = batch()
    out = model(src, tgt)
    for t in range(tgt.size(1) - 1):
        changed = tgt.clone()
        changed[:, t + 1 :] = torch.randint(4, 40, changed[:, t + 1 :].shape)
        out2 = model(src, changed)
        torch.testing.assert_close(out2[:, : t + 1], out[:, : t + 1], rtol=0, atol=1e-12)
        assert not torch.allclose(out2[:, t + 1 :], out[:, t + 1 :])  # the change is visible later


def test_padding_gets_zero_weight_and_pad_contents_do_not_matter():
    model = tiny()
    src, tgt = batch()
    pad = src == PAD
    recorder, records = recording(model)
    out = recorder(src, tgt)
    for r in records:
        if r.kind in ("encoder_self", "cross"):
            assert (r.weights.masked_select(pad[:, None, None, :].expand_as(r.weights)) == 0).all()
    # What sits at padded positions (and their embeddings) never reaches real positions.
    other = src.masked_fill(pad, 7)
    mask = src != PAD
    memory = model.encode(src)
    memory_other = model.encode(other, mask)
    torch.testing.assert_close(memory_other[mask], memory[mask], rtol=0, atol=1e-12)
    torch.testing.assert_close(model.project(model.decode(tgt, memory_other, mask)), out, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "overrides, paper_millions",
    [({}, 65), ({"d_model": 1024, "d_ff": 4096, "n_heads": 16, "dropout": 0.3}, 213)],
)
def test_parameter_counts_match_table3(overrides, paper_millions):
    model = Transformer(ModelConfig(vocab_size=37000, **overrides))
    # Independent count: shared embedding + per layer 4 (enc) / 8 (dec) d^2 attention matrices, FFN, norms.
    d, f, n = model.cfg.d_model, model.cfg.d_ff, model.cfg.n_layers
    ffn = 2 * d * f + f + d
    expected = 37000 * d + n * (4 * d * d + ffn + 2 * 2 * d) + n * (8 * d * d + ffn + 3 * 2 * d)
    assert model.num_parameters() == expected
    assert abs(expected / 1e6 - paper_millions) / paper_millions < 0.05


def test_embeddings_and_output_projection_share_one_tensor():
    model = tiny()
    src, tgt = batch()
    weight = model.embed.tokens.weight
    assert model.embed.weight is weight
    assert sum(p.shape == weight.shape for p in model.parameters()) == 1  # no second (V, d_model) matrix
    states = model.decode(tgt, model.encode(src), model.src_mask(src)).detach()
    with torch.no_grad():
        weight[5] += 1.0  # a copy made at construction would not follow
    torch.testing.assert_close(model.project(states), states @ weight.T)
    emb = model.embed.tokens(src[:1, :3])
    torch.testing.assert_close(emb, weight[src[:1, :3]])


def test_sinusoidal_positional_encoding_formula():
    table = sinusoidal_table(50, 16)
    for pos in (0, 1, 17, 49):
        for i in range(8):
            angle = pos / 10000 ** (2 * i / 16)
            assert table[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert table[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


def test_embedding_scale_and_dropout_free_sum():
    model = tiny()
    src, _ = batch()
    expected = model.embed.tokens(src) * math.sqrt(32) + sinusoidal_table(1024, 32)[: src.size(1)].double()
    torch.testing.assert_close(model.embed(src), expected)


@pytest.mark.parametrize("norm_first", [False, True])
def test_residual_and_layer_norm_placement(norm_first):
    cfg = ModelConfig(
        vocab_size=40, d_model=32, n_heads=4, d_ff=64, n_layers=1, dropout=0.0, norm_first=norm_first
    )
    torch.manual_seed(0)
    layer = EncoderLayer(cfg).double().eval()
    for p in layer.parameters():  # non-trivial norms so that a misplaced norm shows
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    mask = torch.ones(2, 5, dtype=torch.bool)

    def attn(h):
        return layer.self_attn(h, key_mask=mask)

    def ffn(h):
        return layer.ffn.w_2(F.relu(layer.ffn.w_1(h)))

    ln1, ln2 = layer.res_self.norm, layer.res_ffn.norm
    if norm_first:  # x + Sublayer(LayerNorm(x))
        h = x + attn(ln1(x))
        expected = h + ffn(ln2(h))
    else:  # LayerNorm(x + Sublayer(x)), the paper
        h = ln1(x + attn(x))
        expected = ln2(h + ffn(h))
    torch.testing.assert_close(layer(x, mask), expected)
    model = tiny(norm_first=norm_first)
    assert isinstance(model.encoder_norm, torch.nn.LayerNorm) == norm_first
    assert isinstance(model.decoder_norm, torch.nn.LayerNorm) == norm_first


def xavier_bound(fan_in: int, fan_out: int, gain: float = 1.0) -> float:
    """Glorot & Bengio's U(-a, a): a = gain * sqrt(6 / (fan_in + fan_out))."""
    return gain * math.sqrt(6 / (fan_in + fan_out))


def expected_uniform_bounds(init: str, d: int, d_ff: int) -> dict[str, list[float]]:
    """Each weight's U(-a, a) bounds by scheme, block by block along the output rows (0 = all zeros),
    written from the reference implementations' formulas."""
    if init == "t2t":  # tensor2tensor: Xavier on each matrix as it lays them out (Q|K|V, Q and K|V fused)
        attn = {"self_attn.w_qkv": [xavier_bound(d, 3 * d)], "cross_attn.w_q": [xavier_bound(d, d)]}
        attn["cross_attn.w_kv"] = [xavier_bound(d, 2 * d)]
        ffn = {"w_1.weight": xavier_bound(d, d_ff), "w_1.bias": 0, "w_2.weight": xavier_bound(d_ff, d)}
        ffn["w_2.bias"] = 0
    else:  # fairseq: gain 1/sqrt(2) on each of W^Q, W^K, W^V; xavier: gain 1
        block = xavier_bound(d, d, 2**-0.5 if init == "fairseq" else 1.0)
        attn = {"self_attn.w_qkv": [block] * 3, "cross_attn.w_q": [block], "cross_attn.w_kv": [block] * 2}
        if init == "fairseq":  # torch.nn.Linear's own init: U(-1/sqrt(fan_in), 1/sqrt(fan_in)), biases too
            ffn = {
                "w_1.weight": d**-0.5,
                "w_1.bias": d**-0.5,
                "w_2.weight": d_ff**-0.5,
                "w_2.bias": d_ff**-0.5,
            }
        else:
            ffn = {"w_1.weight": xavier_bound(d, d_ff), "w_1.bias": 0, "w_2.weight": xavier_bound(d_ff, d)}
            ffn["w_2.bias"] = 0
    bounds = {}
    for stack in ("encoder", "decoder"):
        for name, blocks in attn.items():
            if stack == "decoder" or name.startswith("self_attn"):
                bounds[f"{stack}.0.{name}.weight"] = blocks
                bounds[f"{stack}.0.{name.split('.')[0]}.w_o.weight"] = [xavier_bound(d, d)]
        for name, bound in ffn.items():
            bounds[f"{stack}.0.ffn.{name}"] = [bound]
    return bounds


@pytest.mark.parametrize("init", ["t2t", "fairseq", "xavier"])
def test_each_initialisation_scheme_draws_every_weight_from_its_formula(init):
    d, d_ff = 256, 1024
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=5000, d_model=d, n_heads=4, d_ff=d_ff, n_layers=1, init=init))
    params = dict(model.named_parameters())
    bounds = expected_uniform_bounds(init, d, d_ff)
    linear = {name for name, p in params.items() if not name.startswith("embed") and "res_" not in name}
    assert linear == set(bounds)  # every weight and bias of the stacks has its formula
    for name, expected in bounds.items():
        for block, bound in zip(params[name].detach().chunk(len(expected)), expected):
            if bound == 0:
                assert (block == 0).all(), name
                continue
            assert block.abs().max().item() <= bound, name  # U(-a, a): never beyond a, close to it,
            assert block.abs().max().item() > 0.97 * bound, name
            assert block.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.05), (
                name
            )  # std a / sqrt(3)
    embedding = model.embed.weight.detach()[1:]
    assert embedding.std().item() == pytest.approx(d**-0.5, rel=0.02)  # N(0, d_model^-0.5) in every scheme
    assert embedding.mean().abs().item() < 0.01 * d**-0.5
    pad_row = model.embed.weight.detach()[PAD]
    assert (pad_row == 0).all() if init == "fairseq" else (pad_row != 0).all()  # fairseq's padding_idx row
    for name, p in params.items():
        if "res_" in name:  # LayerNorm: gain 1, bias 0
            assert (p == (1.0 if name.endswith("weight") else 0.0)).all(), name


def test_xavier_initialisation_is_the_same_as_before_the_schemes_existed():
    """`model.init=xavier` keeps, for the same seed, the very weights of the single scheme before
    (tests/data/xavier_init_seed0.pt: written by that code with this seed and configuration, before
    the encoder's `res_attn` became `res_self`)."""
    torch.manual_seed(0)
    cfg = dict(vocab_size=40, d_model=16, n_heads=4, d_ff=24, n_layers=2, n_kv_heads=2, max_positions=8)
    model = Transformer(ModelConfig(**cfg, positional="learned", init="xavier"))
    before = torch.load(Path(__file__).parent / "data" / "xavier_init_seed0.pt", weights_only=True)
    assert any(".res_attn." in key for key in before)
    before = current_names(before)
    after = model.state_dict()
    assert after.keys() == before.keys()
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"d_model": 500, "n_heads": 8}, "^model.d_model=500 is not divisible by model.n_heads=8"),
        ({"n_kv_heads": 3}, "^model.n_kv_heads=3 must divide model.n_heads=8$"),
        ({"dropout": 1.5}, r"^model.dropout=1.5 must be in \[0, 1\)$"),
        ({"positional": "rotary"}, "^model.positional='rotary' must be one of 'sinusoidal' or 'learned'$"),
        ({"init": "kaiming"}, "^model.init='kaiming' must be one of 't2t', 'fairseq' or 'xavier'$"),
    ],
)
def test_invalid_model_config_gives_clear_message(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**kwargs)


def test_key_size_can_differ_from_d_model_over_h():
    """Table 3, row (B): d_k = 16 with h = 8 and d_model = 512."""
    model = tiny(d_k=4, d_v=4)
    src, tgt = batch()
    assert model(src, tgt).shape == (3, 6, 40)
    assert model.encoder[0].self_attn.w_qkv.weight.shape == (3 * 4 * 4, 32)
