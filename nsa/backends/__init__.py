"""GPU backends behind nsa.dispatch (triton, sdpa, fa2)."""
