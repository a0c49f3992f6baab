"""The speculation seam: one verify step over requests drafted by different drafters and by none."""

from __future__ import annotations

from helpers import chat_prompts

from specserve import Engine
from specserve.executor.commit_path import CommitPath
from specserve.speculative.ngram_worker import NgramWorker
from specserve.speculative.speculation import Speculation

CONTENTS = ["Repeat this list exactly three times: apple, banana, cherry, date.",
            "Count from 1 to 20, separated by commas.", "What is the capital of France?"]
GREEDY = {"temperature": 0, "max_new_tokens": 32}


def test_one_step_mixes_dspark_ngram_and_undrafted_requests(fp32_engine, drafter_dir):
    prompts = chat_prompts(fp32_engine, CONTENTS)
    fp32_engine.scheduler.ledger.tree.reset()
    reference = [o["output_ids"] for o in fp32_engine.generate(input_ids=prompts, sampling_params=GREEDY)]
    engine = Engine(dtype="float32", max_total_tokens=4096, speculative_algorithm="DSPARK",
                    speculative_draft_model_path=drafter_dir, disable_overlap_schedule=True)
    runner = engine.runner
    runner.speculation = Speculation([runner.speculation.worker("DSPARK"), NgramWorker(engine.scheduler.window - 1)])
    # The commit path tells the drafters what committed: it must know the new set of them too.
    runner.commits = CommitPath(runner.future, runner.speculation, runner.request_logits, runner.device)
    drafters_per_step = []
    draft = runner._draft

    def spy(step, *args, **kwargs):
        drafters_per_step.append(list(kwargs["plan"].drafters))
        return draft(step, *args, **kwargs)

    runner._draft = spy
    reqs = [engine.submit(ids, GREEDY) for ids in prompts]
    for req, name in zip(reqs, ["DSPARK", "NGRAM", None]):
        req.drafter = name
    while not all(r.finished for r in reqs):
        engine.step()
    assert [r.output_ids for r in reqs] == reference  # lossless whoever drafted
    assert ["DSPARK", "NGRAM", None] in drafters_per_step  # all three windows in one verify step
    assert reqs[1].spec_num_correct_drafts > 0, "NGRAM drafts from its own histories in a mixed step"
    assert all(r.spec_verify_ct > 0 for r in reqs[:2])
    # The undrafted request's windows were single rows: steps, but none with drafts.
    assert reqs[2].spec_verify_ct == 0 and set(reqs[2].spec_draft_len_hist) == {0}
    engine.scheduler.check_integrity()
    engine.shutdown()
