"""Which checkpoints to keep, and why: the rules, the policy, the planner, and the space budgets."""
