import json
import os

import pytest
import torch

from openglm.model.checkpoint import resolve_checkpoint
from openglm.model.errors import CheckpointError
from openglm.train.trainer import Trainer, TrainingDiverged, train


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_tiny_run_learns_and_writes_telemetry(tiny_cfg, tmp_path):
    res = train(tiny_cfg(max_steps=24, eval_every=8, plots=True))
    first, last = sum(res.losses[s] for s in (1, 2, 3)) / 3, sum(res.losses[s] for s in (22, 23, 24)) / 3
    assert last < first - 1.0, (first, last)
    assert res.val_losses[24] < res.val_losses[8]
    records = [json.loads(line) for line in (res.out_dir / "metrics.jsonl").read_text().splitlines()]
    train_rec = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train_rec] == list(range(2, 25, 2))
    n_moe = res.model_config.num_hidden_layers - res.model_config.first_k_dense_replace
    share = torch.tensor(train_rec[-1]["expert_share"])
    assert share.shape == (n_moe, res.model_config.n_routed_experts)
    # each token picks top-k experts, so the shares of a layer sum to k
    assert torch.allclose(share.sum(1), torch.full((n_moe,), float(res.model_config.num_experts_per_tok)), atol=1e-2)
    assert len(train_rec[-1]["expert_cv"]) == n_moe and 0 <= train_rec[-1]["dropped_fraction"] <= 1
    assert (res.out_dir / "loss.png").stat().st_size > 1000 and (res.out_dir / "expert_load.png").stat().st_size > 1000
    assert resolve_checkpoint(res.out_dir) == res.checkpoint and res.checkpoint.name == "step_0000024"


def test_exact_resume_matches_uninterrupted_run(tiny_cfg, tmp_path):
    full = train(tiny_cfg(out_dir=str(tmp_path / "full"), max_steps=8, save_every=100))
    part = tiny_cfg(out_dir=str(tmp_path / "part"), max_steps=8, save_every=100)
    first = train(part, stop_at=4)
    assert first.step == 4 and first.checkpoint.name == "step_0000004"
    second = train(part, resume=True)
    assert second.step == 8
    for step in range(5, 9):
        assert abs(second.losses[step] - full.losses[step]) <= 1e-6, step
    a, b = _state(full.model), _state(second.model)
    assert all(torch.allclose(a[k], b[k], atol=1e-6, rtol=0) for k in a)


def test_crash_during_save_keeps_previous_checkpoint(tiny_cfg, monkeypatch):
    trainer = Trainer(tiny_cfg(max_steps=8, save_every=4))
    trainer.run(stop_at=4)
    good = resolve_checkpoint(trainer.out)
    import openglm.train.checkpoint as ckpt_mod

    real_save = ckpt_mod.torch.save

    def dying_save(obj, f, *a, **k):
        real_save({"partial": True}, f)  # half-written state, then the "kill"
        raise KeyboardInterrupt("killed mid-save")

    monkeypatch.setattr(ckpt_mod.torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        trainer.run()
    monkeypatch.undo()
    assert resolve_checkpoint(trainer.out) == good
    assert sorted(p.name for p in (trainer.out / "checkpoints").iterdir()) == ["latest", "step_0000004"]
    resumed = Trainer(tiny_cfg(max_steps=8, save_every=4), resume=True)
    assert resumed.step == 4
    assert resumed.run().step == 8


def test_nan_loss_stops_and_names_step_and_checkpoint(tiny_cfg):
    trainer = Trainer(tiny_cfg(max_steps=8, save_every=2))
    real_forward = trainer._forward

    def forward(inputs, targets):
        lm, aux, stats = real_forward(inputs, targets)
        return (lm * float("nan") if trainer.step >= 3 else lm), aux, stats

    trainer._forward = forward
    with pytest.raises(TrainingDiverged, match=r"step 4 .*step_0000002"):
        trainer.run()
    assert resolve_checkpoint(trainer.out).name == "step_0000002"
    assert trainer.step == 3  # the bad step was not applied


def test_resume_with_a_different_config_is_refused(tiny_cfg):
    train(tiny_cfg(max_steps=2, save_every=2))
    with pytest.raises(CheckpointError, match="num_hidden_layers: checkpoint 3 vs now 2"):
        train(tiny_cfg(max_steps=4, model_overrides={"num_hidden_layers": 2, "indexer_types": ["full", "shared"]}),
              resume=True)
    with pytest.raises(CheckpointError, match="train.seq_len"):
        train(tiny_cfg(max_steps=4, seq_len=16), resume=True)


def test_bad_inputs_are_clear_errors(tiny_cfg, tmp_path):
    from openglm.tokenizer import TokenizerError
    from openglm.train.data import CorpusError
    from openglm.train.prepare import TrainSetupError

    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(TrainSetupError, match="not writable"):
        train(tiny_cfg(out_dir=str(blocker / "run")))
    with pytest.raises(CorpusError, match="does not exist"):
        train(tiny_cfg(data=str(tmp_path / "missing")))
    with pytest.raises(TokenizerError, match="too small"):
        train(tiny_cfg(tokenizer=None, vocab_size=100, out_dir=str(tmp_path / "v")))
    with pytest.raises(CheckpointError, match="no checkpoint"):
        train(tiny_cfg(out_dir=str(tmp_path / "fresh")), resume=True)


def test_activation_checkpointing_gives_same_gradients_and_recomputes(tiny_cfg):
    from openglm.train.activations import enable_activation_checkpointing

    plain = Trainer(tiny_cfg())
    ckpt = Trainer(tiny_cfg(out_dir=plain.out.parent / "ac"))
    assert enable_activation_checkpointing(ckpt.model, 2) == 2  # 3 layers -> segments [0, 1], [2]
    calls = []
    for layer in ckpt.model.model.layers:
        layer.self_attn.register_forward_hook(lambda *a: calls.append(1))
    batch = torch.from_numpy(plain.batcher.next_batch(4))
    for t in (plain, ckpt):
        lm, aux, _ = t._forward(batch[:, :-1], batch[:, 1:])
        (lm + aux).backward()
    assert len(calls) == 6  # every layer ran twice: forward + recompute in backward
    for (name, p), q in zip(plain.model.named_parameters(), ckpt.model.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert torch.allclose(p.grad, q.grad, atol=1e-6), name
    assert list(plain.model.state_dict()) == list(ckpt.model.state_dict())  # names unchanged


def test_offloaded_optimizer_matches_adamw(tiny_cfg, tmp_path):
    a = train(tiny_cfg(out_dir=str(tmp_path / "a"), max_steps=4))
    b = train(tiny_cfg(out_dir=str(tmp_path / "b"), max_steps=4, offload_optimizer=True))
    assert all(abs(a.losses[s] - b.losses[s]) < 1e-5 for s in range(1, 5))


def test_run_folder_tokenizer_is_reused_but_not_silently_resized(tiny_cfg, tmp_path):
    from openglm.train.dist import DistInfo
    from openglm.train.prepare import TrainSetupError, prepare_tokens

    cfg = tiny_cfg(tokenizer=None, vocab_size=300, out_dir=str(tmp_path / "t"))
    tok, train_tokens, val_tokens = prepare_tokens(cfg, tmp_path / "t", DistInfo(), log=lambda m: None)
    assert tok.vocab_size == 300 and (tmp_path / "t" / "tokenizer" / "tokenizer.json").is_file()
    assert train_tokens.max() < 300 and len(val_tokens) > 0
    again, _, _ = prepare_tokens(cfg, tmp_path / "t", DistInfo(), log=lambda m: None)  # e.g. on resume
    assert again.hf.to_str() == tok.hf.to_str()
    with pytest.raises(TrainSetupError, match="another output folder"):
        prepare_tokens(cfg.replace(vocab_size=320), tmp_path / "t", DistInfo(), log=lambda m: None)


def test_mtp_loss_trains_and_is_logged(tiny_cfg):
    """A config with a next-n layer trains it: the logged MTP loss (token t+2) falls, and the MTP layer's
    weights move while a run without the MTP loss leaves them at their init."""
    res = train(tiny_cfg(max_steps=24, eval_every=100, model_overrides={"num_nextn_predict_layers": 1}))
    records = [json.loads(line) for line in (res.out_dir / "metrics.jsonl").read_text().splitlines()]
    mtp = [r["mtp_loss"] for r in records if r["kind"] == "train"]
    assert len(mtp) == 12 and mtp[-1] < mtp[0] - 1.0, mtp
    off = Trainer(tiny_cfg(max_steps=2, mtp_loss_weight=0.0, model_overrides={"num_nextn_predict_layers": 1}))
    before = off.model.model.mtp_layers[0].eh_proj.weight.detach().clone()
    off.run()
    assert torch.equal(off.model.model.mtp_layers[0].eh_proj.weight, before)
    assert "mtp_loss" not in json.loads((off.out / "metrics.jsonl").read_text().splitlines()[0])



def test_progress_bar_shows_the_lm_loss_and_mtp_apart(tiny_cfg, capsys):
    """The bar's `loss` is the LM cross-entropy (what the validation loss compares with), not LM + weighted
    MTP/aux terms; the MTP layer's own loss is shown beside it."""
    trainer = Trainer(tiny_cfg(max_steps=2, eval_every=100, log_every=100, progress=True,
                               model_overrides={"num_nextn_predict_layers": 1}))
    res = trainer.run()
    last = [line for line in capsys.readouterr().err.replace("\r", "\n").splitlines() if "2/2" in line][-1]
    lm, mtp = trainer.tracker.rows[-1][0], trainer.tracker.rows[-1][5]
    assert f"loss={lm:.3f}" in last and f"mtp={mtp:.3f}" in last, last
    assert res.losses[2] > lm + 0.2 * mtp  # the total (LM + 0.3 MTP + aux) the bar used to show


def test_checkpoint_config_names_the_tokenizers_special_tokens(tiny_cfg, tmp_path):
    """config.json used to keep the preset's ids (eos 2 = [gMASK] in the run's own tokenizer), so vLLM or
    transformers' generate, which stop at config.json's eos, never stopped; `openglm doctor` flagged the demo's."""
    from openglm.doctor.checkpoint import check_checkpoint
    from openglm.tokenizer import Tokenizer

    result = train(tiny_cfg(max_steps=2, save_every=2))
    config = json.loads((result.checkpoint / "config.json").read_text())
    tok = Tokenizer.from_checkpoint(result.checkpoint)
    assert config["eos_token_id"] == tok.eos_id and config["pad_token_id"] == tok.pad_id
    assert config["bos_token_id"] == tok.bos_ids[-1]
    assert {c.id: c.level for c in check_checkpoint(result.checkpoint)[0]}["checkpoint.eos"] == "ok"
    # a run saved with the preset's ids still resumes (the ids describe the tokenizer, not the weights)
    saved = json.loads((result.checkpoint / "config.json").read_text())
    (result.checkpoint / "config.json").write_text(json.dumps({**saved, "eos_token_id": 2, "bos_token_id": 1}))
    assert train(tiny_cfg(max_steps=4, save_every=2), resume=True).step == 4


def test_checkpoints_follow_the_umask_and_hold_the_template(tiny_cfg):
    """A checkpoint is read by other users (a container's UID, a serving engine): the writer's private temp modes
    (0700 folder, 0600 files) used to be kept by the atomic renames."""
    import stat

    old = os.umask(0o022)
    try:
        result = train(tiny_cfg(max_steps=2, save_every=2))
    finally:
        os.umask(old)
    ckpt = result.checkpoint
    assert (ckpt / "chat_template.jinja").is_file() and (ckpt / "tokenizer.json").is_file()
    assert {stat.S_IMODE(p.stat().st_mode) for p in ckpt.iterdir()} == {0o644}
    assert stat.S_IMODE(ckpt.stat().st_mode) == 0o755
    assert stat.S_IMODE((ckpt.parent / "latest").stat().st_mode) == 0o644
