"""One module per pipeline stage. Each stage is a pure function of its config section and
input artifact refs, writing one verified artifact folder and returning its `ArtifactRef`."""
