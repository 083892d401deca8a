"""dflash-eval on damaged, mismatched and other trainers' drafter folders (issue 36 §7, issue 32 §3): each fault is
one line naming the file, the key and what was expected and found, exit 2; SpecForge's and vLLM speculators'
DFlash folders load and draft exactly as the same weights in this project's layout."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from consumer.export.layout import export_config, write_export
from consumer.model import DFlashDrafter, DrafterArch
from consumer.target_parts import load_target_parts
from evaluation.cli import main
from evaluation.drafter_folder import DrafterFolderError
from evaluation.evaluate import load_drafter

LAYER_IDS = [1, 3]
H = 64


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """A tiny target, a good export of a random 2-layer drafter for it, a prompts file."""
    from demo.tiny import build_tiny_target, train_tokenizer

    root = tmp_path_factory.mktemp("folder")
    tok = train_tokenizer([f"count {i} {i + 1} and say hello" for i in range(100)], 300, root / "tok")
    target = build_tiny_target(root / "target", tok, hidden_size=H, num_layers=4, seed=0)
    parts = load_target_parts(target)
    arch = DrafterArch(
        hidden_size=H,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        num_layers=2,
        num_features=len(LAYER_IDS),
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
    )
    model = DFlashDrafter(arch, parts.embed_tokens, parts.lm_head, init_seed=3)
    cfg = export_config(
        arch, parts, block_size=4, mask_token_id=tok.mask_token_id, target_layer_ids=LAYER_IDS, dtype="float32"
    )
    good = root / "good"
    good.mkdir()
    write_export(good, model.state_dict(), cfg)
    prompts = root / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "say hello"}) + "\n")
    return {"target": target, "good": good, "prompts": prompts, "vocab": parts.vocab_size}


def _copy(assets, tmp_path):
    folder = tmp_path / "drafter"
    shutil.copytree(assets["good"], folder)
    return folder, folder / "model.safetensors", folder / "config.json"


def _edit_weights(file, edit):
    state = load_file(str(file))
    edit(state)
    save_file(state, str(file))


def _edit_config(file, edit):
    cfg = json.loads(file.read_text())
    edit(cfg)
    file.write_text(json.dumps(cfg))


def _missing(folder, weights, config, vocab):
    _edit_weights(weights, lambda s: s.pop("layers.0.mlp.up_proj.weight"))
    return [f"{weights}: tensor 'layers.0.mlp.up_proj.weight' is missing; expected shape [128, 64]"]


def _prefix(folder, weights, config, vocab):
    _edit_weights(weights, lambda s: s.update({f"model.{k}": s.pop(k) for k in list(s)}))
    return [f"{weights}: tensor names carry the prefix 'model.'", "expected the z-lab layout's unprefixed names"]


def _embedding(folder, weights, config, vocab):
    _edit_weights(weights, lambda s: s.update({"embed_tokens.weight": torch.zeros(vocab, H)}))
    return [f"{weights}: holds 'embed_tokens.weight' [{vocab}, {H}]; expected no embed_tokens"]


def _fc_shape(folder, weights, config, vocab):
    _edit_weights(weights, lambda s: s.update({"fc.weight": torch.zeros(H, 3 * H)}))
    return [f"{weights}: tensor 'fc.weight' has shape [64, 192]; expected [64, 128] from config.json", "x 2 target"]


def _layer_count(folder, weights, config, vocab):
    _edit_config(config, lambda c: c.update(num_hidden_layers=3, layer_types=["full_attention"] * 3))
    return [f"{config}: num_hidden_layers is 3; model.safetensors holds layers 0..1 (2)"]


def _truncated(folder, weights, config, vocab):
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 1000])
    return [f"{weights}: truncated or corrupt: its header declares {len(data)} bytes, the file has {len(data) - 1000}"]


def _mask_token(folder, weights, config, vocab):
    _edit_config(config, lambda c: c["dflash_config"].update(mask_token_id=vocab + 7))
    return [
        f"{config}: dflash_config.mask_token_id is {vocab + 7}; expected a token id of the target",
        f"(0..{vocab - 1})",
    ]


def _int8(folder, weights, config, vocab):
    _edit_weights(weights, lambda s: s.update({k: v.to(torch.int8) for k, v in s.items()}))
    return [f"{weights}: tensor '", "' is int8; expected float weights", "a quantized drafter is not evaluated"]


def _not_json(folder, weights, config, vocab):
    config.write_text('{"architectures": ["DFlashDraftModel"],')
    return [f"{config}: not a readable JSON config"]


DEFECTS = [_missing, _prefix, _embedding, _fc_shape, _layer_count, _truncated, _mask_token, _int8, _not_json]


@pytest.mark.parametrize("defect", DEFECTS, ids=lambda f: f.__name__.strip("_"))
def test_a_damaged_folder_is_one_line_naming_file_key_expected_and_found_exit_2(assets, tmp_path, capsys, defect):
    folder, weights, config = _copy(assets, tmp_path)
    wanted = defect(folder, weights, config, assets["vocab"])
    rc = main(["--target", str(assets["target"]), "--drafter", str(folder), "--prompts", str(assets["prompts"])])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("dflash-eval: ")
    for piece in wanted:
        assert piece in err, err


def test_the_undamaged_folder_loads(assets):
    proposer = load_drafter(assets["good"], assets["target"])
    assert proposer.block_size == 4 and proposer.layer_ids == LAYER_IDS


def _same_drafts(a, b) -> None:
    g = torch.Generator().manual_seed(5)
    feats = torch.randn(6, len(LAYER_IDS) * H, generator=g)
    tokens = torch.randint(0, 200, (7,), generator=g)
    assert a.block_size == b.block_size and a.mask_token_id == b.mask_token_id and a.layer_ids == b.layer_ids
    assert torch.equal(a.draft_logits(feats, tokens), b.draft_logits(feats, tokens))


def _speculators_config(cfg: dict, vocab: int) -> dict:
    """The good export's config in vLLM speculators' DFlash layout (speculators models/dflash/config.py)."""
    layer_keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    layer = {k: cfg[k] for k in (*layer_keys, "num_hidden_layers", "rms_norm_eps", "rope_theta", "layer_types")}
    return {
        "speculators_model_type": "dflash",
        "architectures": ["DFlashSpeculator"],
        "transformer_layer_config": {"model_type": "qwen3", "vocab_size": vocab, **layer},
        "draft_vocab_size": vocab,
        "block_size": cfg["block_size"],
        "aux_hidden_state_layer_ids": [i + 1 for i in cfg["dflash_config"]["target_layer_ids"]],
        "mask_token_id": cfg["dflash_config"]["mask_token_id"],
        "sliding_window_non_causal": False,
        "projector_type": "dflash",
        "speculators_config": {"algorithm": "dflash", "default_proposal_method": "greedy"},
    }


def test_a_speculators_dflash_folder_drafts_as_the_same_weights_in_our_layout(assets, tmp_path):
    folder, weights, config = _copy(assets, tmp_path)
    cfg = json.loads(config.read_text())
    config.write_text(json.dumps(_speculators_config(cfg, assets["vocab"])))
    ids = torch.arange(assets["vocab"])
    _edit_weights(weights, lambda s: s.update(d2t=torch.zeros_like(ids), t2d=torch.ones_like(ids, dtype=torch.bool)))
    _same_drafts(load_drafter(folder, assets["target"]), load_drafter(assets["good"], assets["target"]))


def test_a_specforge_folder_loads_as_it_is(assets, tmp_path):
    """SpecForge's save_pretrained: the target's Qwen3 config with the draft's layer count, block_size,
    num_target_layers and dflash_config; weights named as ours (the 'draft_model.' prefix stripped), bf16."""
    folder, weights, config = _copy(assets, tmp_path)
    ours = json.loads(config.read_text())
    target_cfg = json.loads((assets["target"] / "config.json").read_text())
    drop = ("rope_parameters", "layer_types", "auto_map", "bos_token_id", "eos_token_id", "dtype")
    specforge = {
        **{k: v for k, v in target_cfg.items() if k not in drop},
        "architectures": ["DFlashDraftModel"],
        "num_hidden_layers": 2,
        "block_size": 4,
        "num_target_layers": 4,
        "rope_theta": 10000.0,
        "dflash_config": {"mask_token_id": ours["dflash_config"]["mask_token_id"], "target_layer_ids": LAYER_IDS},
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": True,
    }
    config.write_text(json.dumps(specforge))
    _edit_weights(weights, lambda s: s.update({k: v.to(torch.bfloat16) for k, v in s.items()}))
    proposer = load_drafter(folder, assets["target"])
    assert proposer.block_size == 4 and proposer.layer_ids == LAYER_IDS
    assert proposer.model.fc.weight.dtype == torch.float32


@pytest.mark.parametrize(
    ("edit", "wanted"),
    [
        (
            {"draft_vocab_size": 64},
            "draft_vocab_size 64 differs from transformer_layer_config.vocab_size",
        ),
        ({"speculators_model_type": "eagle3"}, "speculators_model_type 'eagle3': only speculators' 'dflash'"),
        ({"projector_type": "domino"}, "projector_type is 'domino'; only 'dflash'"),
        ({"sample_from_anchor": True}, "sample_from_anchor is True; only False"),
        ({"aux_hidden_state_layer_ids": None}, "required key 'aux_hidden_state_layer_ids' is missing or null"),
    ],
)
def test_a_speculators_folder_this_evaluator_cannot_serve_is_refused_naming_the_key(assets, tmp_path, edit, wanted):
    folder, _, config = _copy(assets, tmp_path)
    config.write_text(json.dumps({**_speculators_config(json.loads(config.read_text()), assets["vocab"]), **edit}))
    with pytest.raises(DrafterFolderError, match="^" + str(config).replace(".", r"\.")) as err:
        load_drafter(folder, assets["target"])
    assert wanted in str(err.value)


def test_an_eagle3_folder_is_refused_by_its_architecture(assets, tmp_path, capsys):
    folder, _, config = _copy(assets, tmp_path)
    _edit_config(config, lambda c: c.update(architectures=["LlamaForCausalLMEagle3"]))
    rc = main(["--target", str(assets["target"]), "--drafter", str(folder), "--prompts", str(assets["prompts"])])
    assert rc == 2
    assert (
        "architectures ['LlamaForCausalLMEagle3']: only DFlashDraftModel, DFlash2DraftModel and Qwen3DSparkModel"
        in capsys.readouterr().err
    )


def test_sharded_weights_with_an_index_load_as_one_file(assets, tmp_path):
    folder, weights, _ = _copy(assets, tmp_path)
    state = load_file(str(weights))
    weights.unlink()
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(folder / shard))
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    _same_drafts(load_drafter(folder, assets["target"]), load_drafter(assets["good"], assets["target"]))
