"""Online distillation: soft-label positions, determinism, LoRA merge, metadata carried forward, errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from devkit.models import tiny_llama
from online.config import TrainerConfig
from online.trainer.common import NotEnoughData, TrainingError
from online.trainer.distill import distill, prepare_examples
from runtime.drafters.factory import load_model_drafter
from runtime.errors import ModelLoadError
from runtime.loader import DRAFTER_META
from runtime.trace import RequestTrace, StepRecord

VOCAB = 96
KEPT = list(range(0, VOCAB, 2))
FAST = dict(steps=6, batch_size=4, lr=1e-2)


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny") / "drafter"
    tiny_llama(VOCAB, layers=1, seed=1).save_pretrained(d)
    (d / DRAFTER_META).write_text(json.dumps({"version": "tiny-d1", "kept_ids": KEPT, "layers": 1}))
    return d


@pytest.fixture(scope="module")
def traffic():
    """Eight seeded synthetic greedy traces: one verify step per 3 output tokens, each rejected after
    one accepted token, with a top-4 soft label whose argmax is the logged token (as the engine logs it)."""
    gen = torch.Generator().manual_seed(0)
    traces = []
    for i in range(8):
        prompt = torch.randint(3, VOCAB, (6,), generator=gen).tolist()
        output = torch.randint(3, VOCAB, (20,), generator=gen).tolist()
        steps = []
        for pos in range(0, 18, 3):
            others = [t for t in torch.randperm(VOCAB, generator=gen).tolist() if t != output[pos + 1]][:3]
            steps.append(StepRecord(pos, [output[pos], 0, 0], "model", 1, topk_ids=[output[pos + 1], *others],
                                    topk_logprobs=[-0.4, -2.2, -2.6, -3.0]))
        traces.append(RequestTrace(f"r{i}", prompt, output, steps, "tiny", "tiny-d1", max_new_tokens=20))
    return traces


def weights(d):
    return load_file(d / "model.safetensors")


def test_soft_labels_land_on_the_first_rejected_output_position():
    # prompt [5, 6]; step at pos 1 drafted 3 tokens, accepted 1: the label is for output index 2,
    # predicted by logits row len(prompt) + 2 - 1 = 3 (whose input is output[1]).
    t = RequestTrace("r", [5, 6], [7, 8, 9, 10], [
        StepRecord(1, [8, 1, 1], "model", 1, topk_ids=[9, 4], topk_logprobs=[-0.1, -3.0]),
        StepRecord(3, [11], "model", 0, topk_ids=[10], topk_logprobs=[-0.2]),
        StepRecord(4, [1], "model", 0, topk_ids=[3], topk_logprobs=[-0.2]),  # past the end: dropped
        StepRecord(0, [], "none", 0),
    ], "tiny", "d")
    (ex,), skipped = prepare_examples([t], VOCAB, 64)
    assert skipped == 0
    assert ex.soft_rows == [3, 4]
    assert [ex.ids[r + 1] for r in ex.soft_rows] == [9, 10]  # each label's argmax is the token that row predicts
    assert ex.soft_ids == [[9, 4], [10]]
    assert ex.first_output_row == 1


def test_unusable_traces_are_skipped_not_fatal():
    good = RequestTrace("a", [5], [6, 7], [], "tiny", "d")
    out_of_vocab = RequestTrace("b", [5], [VOCAB + 3], [], "tiny", "d")
    too_long = RequestTrace("c", [5] * 60, [6] * 10, [], "tiny", "d")
    empty = RequestTrace("d", [5], [], [], "tiny", "d")
    examples, skipped = prepare_examples([good, out_of_vocab, too_long, empty], VOCAB, 64)
    assert [e.ids for e in examples] == [[5, 6, 7]]
    assert skipped == 3


def test_same_seed_same_weights_other_seed_other_weights(drafter_dir, traffic, tmp_path):
    a = distill(drafter_dir, traffic, tmp_path / "a", TrainerConfig(seed=3, **FAST))
    torch.rand(5)  # global RNG state must not matter
    b = distill(drafter_dir, traffic, tmp_path / "b", TrainerConfig(seed=3, **FAST))
    c = distill(drafter_dir, traffic, tmp_path / "c", TrainerConfig(seed=4, **FAST))
    wa, wb, wc = weights(a.out_dir), weights(b.out_dir), weights(c.out_dir)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert a.losses == b.losses
    assert not all(torch.equal(wa[k], wc[k]) for k in wa)
    assert a.steps == 6 and len(a.losses) == len(a.kd_losses) == len(a.ce_losses) == 6
    assert a.soft_labels > 0 and a.tokens == sum(len(t.output_ids) for t in traffic)


def test_training_lowers_the_loss(drafter_dir, traffic, tmp_path):
    res = distill(drafter_dir, traffic, tmp_path / "d", TrainerConfig(steps=30, batch_size=8, lr=1e-2, loss="jsd"))
    assert sum(res.losses[-3:]) < sum(res.losses[:3])


def test_candidate_directory_carries_metadata_forward(drafter_dir, traffic, tmp_path):
    res = distill(drafter_dir, traffic, tmp_path / "cand", TrainerConfig(**FAST), version="v-next",
                  provenance={"window": {"start": 0, "end": 8}})
    meta = json.loads((res.out_dir / DRAFTER_META).read_text())
    assert meta["kept_ids"] == KEPT and meta["layers"] == 1
    assert meta["version"] == "v-next" and meta["parent_version"] == "tiny-d1"
    assert meta["window"] == {"start": 0, "end": 8}
    assert meta["training"]["loss"] == "fkl" and meta["training"]["steps_done"] == 6
    drafter = load_model_drafter(res.out_dir, None)
    assert drafter.version == "v-next" and drafter.kept_ids.tolist() == KEPT
    assert not list(tmp_path.glob(".cand-*"))  # the temp directory was renamed into place


def test_lora_is_merged_into_a_plain_model(drafter_dir, traffic, tmp_path):
    cfg = TrainerConfig(lora=True, lora_r=4, **FAST)
    a = distill(drafter_dir, traffic, tmp_path / "a", cfg)
    b = distill(drafter_dir, traffic, tmp_path / "b", cfg)
    parent, wa, wb = weights(drafter_dir), weights(a.out_dir), weights(b.out_dir)
    assert wa.keys() == parent.keys()  # no adapter tensors left
    assert not (a.out_dir / "adapter_config.json").exists()
    assert not torch.equal(wa["model.layers.0.self_attn.q_proj.weight"],
                           parent["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(wa["model.layers.0.mlp.up_proj.weight"],
                       parent["model.layers.0.mlp.up_proj.weight"])  # not targeted
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    load_model_drafter(a.out_dir, None)


def test_seconds_budget_stops_training(drafter_dir, traffic, tmp_path):
    res = distill(drafter_dir, traffic, tmp_path / "d", TrainerConfig(steps=10_000, max_seconds=1e-9))
    assert res.steps == 1


def test_errors_say_what_to_do(drafter_dir, traffic, tmp_path):
    with pytest.raises(TrainingError, match="choose one of"):
        distill(drafter_dir, traffic, tmp_path / "x", TrainerConfig(loss="kl"))
    with pytest.raises(TrainingError, match="lora_target_modules"):
        distill(drafter_dir, traffic, tmp_path / "x", TrainerConfig(lora=True, lora_target_modules="nope", **FAST))
    with pytest.raises(NotEnoughData, match="collect more traffic"):
        distill(drafter_dir, [RequestTrace("a", [5], [], [], "tiny", "d")], tmp_path / "x", TrainerConfig())
    no_labels = [RequestTrace("a", [5], [6, 7], [], "tiny", "d")]
    with pytest.raises(TrainingError, match="ce_weight > 0"):
        distill(drafter_dir, no_labels, tmp_path / "x", TrainerConfig(ce_weight=0.0))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "f").write_text("x")
    with pytest.raises(FileExistsError, match="not empty"):
        distill(drafter_dir, traffic, tmp_path / "full", TrainerConfig(**FAST))
    with pytest.raises(ModelLoadError, match="choose cpu, cuda"):
        distill(drafter_dir, traffic, tmp_path / "y", TrainerConfig(**FAST), device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="no CUDA device"):
            distill(drafter_dir, traffic, tmp_path / "y", TrainerConfig(**FAST), device="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_model_drafter_trains_on_cuda_as_on_the_cpu(drafter_dir, traffic, tmp_path):
    """The daemon's model-drafter rounds on a GPU host: the batches follow the drafter onto the device,
    and the candidate it writes loads and learned as on the CPU."""
    cpu = distill(drafter_dir, traffic, tmp_path / "cpu", TrainerConfig(**FAST))
    gpu = distill(drafter_dir, traffic, tmp_path / "gpu", TrainerConfig(**FAST), device="cuda")
    assert gpu.steps == cpu.steps and gpu.losses[-1] < gpu.losses[0]
    assert gpu.losses[0] == pytest.approx(cpu.losses[0], rel=1e-3)
    assert weights(gpu.out_dir).keys() == weights(cpu.out_dir).keys()


def test_trainer_config_reads_from_file_and_environment(tmp_path):
    from online.config import load_config

    f = tmp_path / "livedraft.toml"
    f.write_text('[trainer]\nloss = "jsd"\nlora = true\nlora_target_modules = "q_proj, v_proj"\n')
    cfg = load_config(f, env={"LIVEDRAFT_TRAINER__LR": "0.01"}).trainer
    assert (cfg.loss, cfg.lora, cfg.lr) == ("jsd", True, 0.01)
    assert cfg.lora_modules == ["q_proj", "v_proj"]
