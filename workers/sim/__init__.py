"""The seeded fault explorer (issue #55): `explore` runs seeds, `run_seed` one, each over the real job code
(`workers.sim.world`), its faults and time simulated (`workers.sim.kernel`), judged by `workers.sim.checker`."""
