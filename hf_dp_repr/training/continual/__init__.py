"""Public → private continual training: the non-private phase and its record (`public_phase`), and the Hessian-trace
estimates that decide when to switch (`curvature`)."""
