"""Research instruments, not the user's CLI: the decision rules on simulated runs with known costs (decision_sim,
verify_sim) and which choices of the space won where, read from committed tuning reports (winners)."""
