"""EAGLE-3 draft model and its training maths. No I/O orchestration lives here."""
