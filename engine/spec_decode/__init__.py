"""Speculative decoding: propose draft tokens cheaply, verify them all in one forward pass of the
target model, keep the target's distribution exactly.

    ngram.py       the n-gram (prompt lookup) proposer: drafts copied from the sequence itself
    draft_model.py a smaller model's greedy guesses, its K/V in the target's block tables
    rejection.py   verification: rejection sampling over the k + 1 positions' logits
    policy.py      how many drafts a step verifies: those expected to pay for their rows
    step_costs.py  a step's measured cost by its number of query tokens, for the policy
    planner.py     each step's proposals cut by the policy; the steps' times measured

The engine proposes before each step (`DraftPlanner.propose`; a draft model gives placeholders
there and its tokens once the scheduler has placed the step, `DraftModel.fill`); the scheduler
schedules a decode with drafts as 1 + k query tokens and, after the step, appends the emitted
tokens and rolls the rejected drafts' KV slots back (`Scheduler.update_from_output`,
`BlockManager.rollback_slots`); the model runner verifies (`ModelRunner._launch`), on CUDA
replaying the decode graphs one row per token (engine/spec_graphs.py).
"""
