"""A failure to join Ray names what to check, the auth token setting first."""
import pytest

from cluster import ray_join


@pytest.fixture
def failing_ray(monkeypatch):
    import ray

    def init(address=None, **kwargs):
        raise ConnectionError(f"Failed to connect to Ray cluster at {address}")

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)


def test_a_failed_join_names_the_token_setting(failing_ray):
    with pytest.raises(ray_join.RayJoinError) as info:
        ray_join.init_ray("10.0.0.1:6379", "kvrelay")
    message = str(info.value)
    assert "10.0.0.1:6379" in message and "Failed to connect" in message
    assert "RAY_AUTH_MODE=token" in message and "RAY_AUTH_TOKEN" in message and "~/.ray/auth_token" in message
    assert isinstance(info.value, ConnectionError)


def test_a_token_that_is_set_is_named_as_the_suspect(failing_ray, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_TOKEN", "wrong")
    with pytest.raises(ray_join.RayJoinError, match="RAY_AUTH_TOKEN is set: check that it holds"):
        ray_join.init_ray("10.0.0.1:6379", "kvrelay")


def test_other_errors_pass_through(monkeypatch):
    import ray

    def init(**kwargs):
        raise RuntimeError("Maybe you called ray.init twice by accident?")

    monkeypatch.setattr(ray, "init", init)
    with pytest.raises(RuntimeError, match="twice"):
        ray_join.init_ray(None, "kvrelay")
