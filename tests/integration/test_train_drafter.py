"""train-drafter smoke run (tiny corpus and budget): the loss goes down, the teacher recomputed from
token ids agrees with the generated tokens, checkpoints resume (full and weights-only), the drafter
it writes serves losslessly; eval-acceptance writes its JSON and plot; the draft-vocabulary map."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from specserve import Engine
from specserve.cli import main as cli_main
from benchmarks.cli import main as experiments_main
from specserve.train.corpus_store import CorpusStore
from specserve.train.teacher import TeacherCache, TeacherCorpus

SMOKE = ["--seqs-per-step", "6", "--anchors-per-seq", "8", "--held-out", "2", "--checkpoint-every", "10",
         "--draft-vocab-size", "2048", "--lr", "2e-3", "--seed", "5"]


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    data = tmp_path_factory.mktemp("corpus")
    assert cli_main(["drafter-corpus", "extend", "--data", str(data), "--source", "sharegpt-greedy", "--num-prompts",
                     "10", "--max-new-tokens", "40", "--batch-size", "10"]) == 0
    return str(data)


@pytest.fixture(scope="module")
def trained(corpus_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("trained")
    assert cli_main(["train-drafter", "--data", corpus_dir, "--out", str(out), "--steps", "40", *SMOKE]) == 0
    with open(out / "train_history.json") as f:
        return str(out), json.load(f)


def test_loss_goes_down_and_files_are_written(trained, corpus_dir):
    out, summary = trained
    losses = [h["loss"] for h in summary["history"]]
    assert len(losses) == 40
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses
    for name in ("config.json", "model.safetensors", "checkpoint.pt", "train_state.json", "README.md"):
        assert os.path.isfile(os.path.join(out, name)), name
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["draft_vocab_size"] == 2048 and cfg["extra"]["training_steps"] == 40
    store = CorpusStore(corpus_dir)
    state = json.load(open(os.path.join(out, "train_state.json")))
    assert len(state["extensions"]) == 1
    assert state["extensions"][0]["train_sequences"] == store.counts()["sequences"] - 2  # --held-out 2
    assert "| 0 |" in open(os.path.join(out, "README.md")).read()
    # The teacher recomputed from the committed ids: its top-1 is the token the target generated.
    cache = TeacherCache(os.path.join(corpus_dir, "cache"), cfg["target_layer_ids"], 16, "SmolLM2-135M-Instruct.Q4_1.gguf")
    seqs = TeacherCorpus([cache.load(s) for s in store.shards], cfg["target_layer_ids"], 16).materialise().sequences
    seq = seqs[0]
    assert seq.hidden.shape == (len(seq.ids), 3 * 576) and seq.hidden.dtype == torch.bfloat16
    assert seq.top_ids.shape == (len(seq.ids) - 1 - seq.prompt_len, 16)
    agree = torch.cat([(s.top_ids[:, 0] == s.ids[s.prompt_len + 1:]).float() for s in seqs]).mean()
    assert agree > 0.95


def test_resume_continues_from_the_checkpoint(trained, corpus_dir, tmp_path):
    out, _ = trained
    resumed = tmp_path / "resumed"
    shutil.copytree(out, resumed)
    assert cli_main(["train-drafter", "--data", corpus_dir, "--out", str(resumed), "--steps", "5", "--resume",
                     *SMOKE]) == 0
    summary = json.load(open(resumed / "train_history.json"))
    assert [h["step"] for h in summary["history"]] == [41, 42, 43, 44, 45]
    extensions = json.load(open(resumed / "train_state.json"))["extensions"]
    assert len(extensions) == 2 and extensions[-1]["started_from"] == "checkpoint.pt"  # with optimizer state
    # A checkpoint.pt older than the weights (left from an earlier stretch) must not roll them back.
    shutil.copy(os.path.join(out, "checkpoint.pt"), resumed / "checkpoint.pt")  # step 40 < 45
    assert cli_main(["train-drafter", "--data", corpus_dir, "--out", str(resumed), "--steps", "1", "--resume",
                     *SMOKE]) == 0
    assert [h["step"] for h in json.load(open(resumed / "train_history.json"))["history"]] == [46]
    assert json.load(open(resumed / "train_state.json"))["extensions"][-1]["started_from"] == "weights"


def test_resume_continues_an_interrupted_run_but_not_an_unrecorded_finished_one(trained, corpus_dir, tmp_path):
    """The line is at step 40 (weights and record). A finished run's checkpoint.pt at step 45 (its weights
    and record reset, the checkpoint left behind) is not continued; an interrupted run's is, and the
    record's "before" scores the checkpoint's weights, the ones the run starts from."""
    out, _ = trained
    line = tmp_path / "line"
    shutil.copytree(out, line)
    ckpt = torch.load(line / "checkpoint.pt", weights_only=True)
    # Zeroed weights score the floor (only the bonus token), below the line's trained drafter.
    ckpt.update(step=45, drafter={k: torch.zeros_like(v) for k, v in ckpt["drafter"].items()})
    recorded_after = json.load(open(line / "train_state.json"))["extensions"][-1]["held_out_teacher_forced"]["after"]
    for finished, first_step, started_from in ((True, 41, "weights"), (False, 46, "checkpoint.pt")):
        torch.save({**ckpt, "finished": finished}, line / "checkpoint.pt")
        shutil.copy(os.path.join(out, "train_state.json"), line / "train_state.json")
        assert cli_main(["train-drafter", "--data", corpus_dir, "--out", str(line), "--steps", "1", "--resume",
                         *SMOKE]) == 0
        assert [h["step"] for h in json.load(open(line / "train_history.json"))["history"]] == [first_step]
        record = json.load(open(line / "train_state.json"))["extensions"][-1]
        assert record["started_from"] == started_from
        before = record["held_out_teacher_forced"]["before"]["accept_length"]
        # The card's weights (bf16) score about the recorded "after"; the zeroed checkpoint the floor.
        floor = 1.0 + 0.1 * (recorded_after["accept_length"] - 1.0)
        assert (before > floor) if finished else (before <= floor), (before, recorded_after)


def test_resume_from_committed_weights_only(trained, corpus_dir, tmp_path):
    """The committed form (bf16 weights + train_state.json, no optimizer state) resumes too."""
    out, _ = trained
    committed = tmp_path / "committed"
    shutil.copytree(out, committed)
    os.remove(committed / "checkpoint.pt")
    assert cli_main(["train-drafter", "--data", corpus_dir, "--out", str(committed), "--steps", "3", "--resume",
                     *SMOKE]) == 0
    assert [h["step"] for h in json.load(open(committed / "train_history.json"))["history"]] == [41, 42, 43]
    assert json.load(open(committed / "train_state.json"))["extensions"][-1]["started_from"] == "weights"


def test_checkpoints_load_weights_only_and_refuse_pickled_objects(tmp_path):
    import random

    from specserve.train.trainer import load_checkpoint, save_checkpoint

    layer = torch.nn.Linear(3, 3)
    opt = torch.optim.AdamW(layer.parameters(), betas=(0.9, 0.95))
    layer(torch.ones(1, 3)).sum().backward()
    opt.step()
    rng = random.Random(7)
    save_checkpoint(str(tmp_path / "c.pt"), layer, opt, 12, rng)
    state = load_checkpoint(str(tmp_path / "c.pt"))
    restored = random.Random()
    restored.setstate(state["rng"])
    assert state["step"] == 12 and restored.random() == rng.random()
    torch.optim.AdamW(layer.parameters()).load_state_dict(state["optimizer"])
    torch.save({"drafter": {}, "optimizer": {}, "step": 1, "rng": random.Random}, tmp_path / "evil.pt")
    with pytest.raises(ValueError, match="weights-only"):
        load_checkpoint(str(tmp_path / "evil.pt"))


def test_trained_drafter_is_lossless(trained, fp32_engine):
    out, _ = trained
    prompt = fp32_engine.tokenizer.apply_chat_template([{"role": "user", "content": "Name three primary colours."}])
    params = {"temperature": 0, "max_new_tokens": 32}
    base = fp32_engine.generate(input_ids=prompt, sampling_params=params)["output_ids"]
    spec = Engine(dtype="float32", max_total_tokens=2048, speculative_algorithm="DSPARK",
                  speculative_draft_model_path=out)
    assert spec.runner.speculation.worker("DSPARK").drafter.reduced_vocab
    got = spec.generate(input_ids=prompt, sampling_params=params)
    assert got["output_ids"] == base
    assert got["meta_info"]["spec_verify_ct"] > 0
    # Sampling through the reduced vocabulary: q lives on target ids, drafts are target ids.
    sampled = spec.generate(input_ids=prompt, sampling_params={"temperature": 0.8, "seed": 1, "max_new_tokens": 16})
    assert len(sampled["output_ids"]) == 16 and all(0 <= t < 49152 for t in sampled["output_ids"])
    spec.shutdown()


def test_eval_acceptance_writes_json_and_plot(trained, tmp_path):
    out, _ = trained
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p, "category": c}) for p, c in
                                 [("Count from 1 to 10.", "count"), ("List the days of the week.", "list")]))
    result, png = tmp_path / "eval.json", tmp_path / "eval.png"
    assert cli_main(["eval-acceptance", "--dataset", str(prompts), "--algorithms", "DSPARK,NGRAM,NONE",
                     "--temperatures", "0,0.7", "--max-new-tokens", "24", "--out", str(result), "--plot", str(png),
                     "--speculative-draft-model-path", out, "--max-total-tokens", "2048"]) == 0
    report = json.load(open(result))
    rows = {(r["algorithm"], r["temperature"]): r for r in report["results"]}
    assert set(rows) == {(a, t) for a in ("DSPARK", "NGRAM", "NONE") for t in (0.0, 0.7)}
    dspark = rows[("DSPARK", 0.0)]
    assert 1.0 <= dspark["accept_length"] <= dspark["gamma"] + 1
    assert len(dspark["per_position"]) == dspark["gamma"] == 5
    assert all(a >= b for a, b in zip(dspark["per_position"], dspark["per_position"][1:]))  # survival is monotone
    assert set(dspark["per_category"]) == {"count", "list"} and "speedup_over_none" in dspark
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_eval_acceptance_rejects_unknown_dataset(capsys):
    assert cli_main(["eval-acceptance", "--dataset", "nope"]) == 2
    assert "--dataset must be" in capsys.readouterr().err


def test_promotion_replaces_only_with_a_drafter_accepted_longer(trained, corpus_dir, tmp_path):
    from specserve.assets import default_drafter_path
    from specserve.train.run import promote

    weak, shipped = tmp_path / "weak", tmp_path / "shipped"
    shutil.copytree(trained[0], weak)
    shutil.copytree(default_drafter_path(), shipped)
    before = (shipped / "model.safetensors").read_bytes()
    files = {name: (shipped / name).read_bytes() for name in os.listdir(shipped)}
    kept = promote(str(weak), str(shipped), 2, corpus_dir, None, max_new_tokens=32)
    assert not kept["promoted"] and kept["new_dev_accept_length"] < kept["shipped_dev_accept_length"]
    assert {name: (shipped / name).read_bytes() for name in os.listdir(shipped)} == files  # untouched
    assert json.load(open(weak / "train_state.json"))["extensions"][-1]["dev"] == kept

    replaced = promote(str(shipped), str(weak), 2, corpus_dir, None, max_new_tokens=32)
    assert replaced["promoted"]
    assert (weak / "model.safetensors").read_bytes() == before and (weak / "dev_eval.json").is_file()
    assert sorted(os.listdir(tmp_path)) == ["shipped", "weak"]  # no staging or retired folder left


def test_resume_and_init_from_together_are_refused(trained, corpus_dir, capsys):
    assert cli_main(["train-drafter", "--data", corpus_dir, "--out", trained[0], "--resume",
                     "--init-from", trained[0]]) == 2
    assert "give one of them" in capsys.readouterr().err


def test_drafter_sources_bench_prices_new_data_and_scores_each_arm(trained, corpus_dir, tmp_path):
    """Two arms from the smoke drafter: more training on its own shard (paid for: training only) and a
    new off-policy shard (its teacher prefill is built, timed and charged)."""
    data = tmp_path / "corpus"
    shutil.copytree(corpus_dir, data)
    assert cli_main(["drafter-corpus", "extend", "--data", str(data), "--source", "sharegpt-answers",
                     "--num-prompts", "6"]) == 0
    out = tmp_path / "sources.json"
    assert experiments_main(["drafter-sources", "--drafter", trained[0], "--data", str(data), "--minutes", "0.05",
                     "--dev-prompts", "2", "--max-new-tokens", "24", "--seen", "0", "--work", str(tmp_path / "arms"),
                     "--arms", "seen:sharegpt-greedy:0,answers:sharegpt-answers:1", "--out", str(out)]) == 0
    result = json.load(open(out))
    seen, answers = result["arms"]["seen"], result["arms"]["answers"]
    assert seen["cost"]["making_s"] == 0 and seen["cost"]["teacher_s"] == 0
    assert seen["cost"]["total_s"] == seen["cost"]["train_s"] > 0
    assert answers["shards"] == ["00001-sharegpt-answers.npz"] and answers["cost"]["teacher_s"] > 0
    start = result["start"]["served"]["accept_length"]
    for arm in (seen, answers):
        # the offline walk replays every served request step for step
        assert arm["dev"]["served"]["accept_length"] >= 1.0
        assert arm["dev"]["walk_equals_served"] == arm["dev"]["requests"] > 0
        assert arm["dev_gain"] == pytest.approx(arm["dev"]["served"]["accept_length"] - start, abs=1e-4)
        assert arm["gain_per_machine_hour"] == pytest.approx(arm["dev_gain"] / (arm["cost"]["total_s"] / 3600),
                                                             rel=1e-3, abs=1e-3)


def test_drafter_shapes_bench_trains_each_shape_and_times_it(corpus_dir, tmp_path):
    out = tmp_path / "shapes.json"
    assert experiments_main(["drafter-shapes", "--data", corpus_dir, "--shards", "0", "--minutes", "0.05",
                     "--arms", "v2048=--draft-vocab-size 2048;block4=--draft-vocab-size 1024 --block-size 4",
                     "--dev-prompts", "2", "--max-new-tokens", "16", "--speed-prompts", "2", "--speed-tokens", "12",
                     "--work", str(tmp_path / "arms"), "--out", str(out)]) == 0
    result = json.load(open(out))
    assert set(result["arms"]) == {"v2048", "block4"} and len(result["plain_runs"]) == 1
    assert json.load(open(tmp_path / "arms" / "block4" / "config.json"))["block_size"] == 4
    for arm in result["arms"].values():
        assert arm["steps"] > 0 and arm["dev_accept_length"] >= 1.0 and not arm["trained_in_an_earlier_run"]
        assert 0 < arm["batch1"]["drafting_ms"] < arm["batch1"]["verify_step_ms"]
        assert arm["batch1_speedup_vs_none"] == pytest.approx(arm["batch1"]["tokens_per_s"] /
                                                              result["plain_runs"][0]["tokens_per_s"], abs=2e-3)
    # A second run with the same settings adds to the record: block4 is served again, not trained
    # again, and timed against the second run's own NONE (tests/unit: which records are reused).
    assert experiments_main(["drafter-shapes", "--data", corpus_dir, "--shards", "0", "--minutes", "0.05",
                     "--arms", "v2048=--draft-vocab-size 2048;block4=--draft-vocab-size 1024 --block-size 4",
                     "--only", "block4", "--dev-prompts", "2", "--max-new-tokens", "16", "--speed-prompts", "2",
                     "--speed-tokens", "12", "--work", str(tmp_path / "arms"), "--out", str(out)]) == 0
    again = json.load(open(out))
    assert len(again["plain_runs"]) == 2 and again["arms"]["v2048"] == result["arms"]["v2048"]
    block4 = again["arms"]["block4"]
    assert block4["trained_in_an_earlier_run"] and block4["plain_run"] == 1
    assert block4["steps"] == result["arms"]["block4"]["steps"]
