"""Tools beside the stages: the wiring doctor, SGLang serving, the served benchmark, and
SGLang's own load check of an export. They read a run's artefacts; they build none."""
