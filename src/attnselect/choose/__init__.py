"""Which candidate serves a problem, and why: verdicts from the backends' surfaces, the allowlists, the rules and
measure policies with their timing harness, the recorded failures and the decision cache, and the decision they make."""
