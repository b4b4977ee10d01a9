from tests.launcher.conftest import cluster  # noqa: F401 - the launcher fixture, shared
