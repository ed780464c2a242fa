"""Standard Webhooks signatures and the webhook settings that cannot work."""

from __future__ import annotations

import base64

import pytest

import tests.support.tasks_fixture  # noqa: F401  (registers the echo tasks in this process too)
from worker.engine import webhooks
from worker.engine.config import Config, ConfigError

SECRET = "whsec_" + base64.b64encode(b"a key of thirty-two bytes, fixed").decode()


def test_the_signature_matches_the_standard_webhooks_example() -> None:
    # The example of the Standard Webhooks reference libraries.
    key = base64.b64decode("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
    signature = webhooks.sign(
        key, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, b'{"test": 2432232314}'
    )
    assert signature == "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"THUMBQ_WEBHOOK_URL": "https://example.com/h"}, "set THUMBQ_WEBHOOK_SECRET"),
        ({"THUMBQ_WEBHOOK_URL": "ftp://x", "THUMBQ_WEBHOOK_SECRET": SECRET}, "http(s) URL"),
        ({"THUMBQ_WEBHOOK_URL": "https://e.com/h", "THUMBQ_WEBHOOK_SECRET": "s3cret"}, "whsec_"),
    ],
)
def test_a_webhook_setting_that_cannot_work_is_a_configuration_error(
    env: dict[str, str], says: str
) -> None:
    with pytest.raises(ConfigError, match="THUMBQ_WEBHOOK") as err:
        Config.from_env(env)
    assert says in str(err.value)
