"""The chaos suite shares the end-to-end tests' local Ray instance."""
from tests.e2e.conftest import ray_instance  # noqa: F401
