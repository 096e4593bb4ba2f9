"""The driver: the parts a mode's loop is made of (see run.py). It handles group records (prompt,
rewards, version), never trajectories."""
