"""test_kubernetes.py's cases that need no control of the API server, against a REAL cluster:
opt-in, skipped unless CKPTD_TEST_KUBECONFIG names a kubeconfig (a kind or minikube cluster will
do). Its user needs get, create, update and delete on leases in the context's namespace (or
CKPTD_TEST_KUBE_NAMESPACE); each test's Leases (ckptd-<a fresh volume id>) are deleted after it.
The API server cannot be stopped or frozen from here, so those cases stay with the fake."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.fleet.test_kubernetes import (  # noqa: F401 (collected here again, with this module's `kube`)
    test_a_frozen_leader_is_replaced_and_deletes_nothing_when_it_wakes,
    test_a_prune_after_a_killed_holder_watches_its_lease_lapse_then_deletes,
    test_a_prune_does_not_delete_while_a_daemon_holds_the_lease_and_does_once_it_stopped,
    test_a_renewal_that_finds_another_holder_stands_down_before_the_volume_says_so,
    test_a_second_lease_for_the_same_root_is_not_taken_beside_a_live_one,
    test_a_whole_second_goes_out_with_the_six_fraction_digits_the_api_server_parses,
    test_every_take_moves_leasetransitions_on_even_with_no_record_on_the_volume,
    test_expiry_is_judged_by_this_processs_monotonic_clock_never_by_the_holders_renew_time,
    test_of_two_standbys_that_decide_at_once_the_api_server_lets_one_win,
    test_one_deletes_and_a_killed_leader_is_replaced_with_the_next_token,
    test_the_fence_asks_the_api_server_and_refuses_once_the_lease_is_not_this_leaders,
    test_the_fence_refuses_past_the_deadline_by_its_own_clock,
    test_the_fence_refuses_where_the_volume_names_another_token,
)

KUBECONFIG = os.environ.get("CKPTD_TEST_KUBECONFIG")
pytestmark = pytest.mark.skipif(not KUBECONFIG, reason="a real cluster: set CKPTD_TEST_KUBECONFIG (opt-in)")


class RealKube:
    """A real API server through a kubeconfig: what the tests ask of FakeKube that a real one can do."""

    def __init__(self, source: Path, workdir: Path):
        from lightkube import Client, KubeConfig

        config = KubeConfig.from_file(source).get()
        self.namespace = os.environ.get("CKPTD_TEST_KUBE_NAMESPACE") or config.namespace or "default"
        # The daemons read a copy that names the namespace (the context's may name none).
        self.kubeconfig = workdir / "kubeconfig"
        text = source.read_text()
        self.kubeconfig.write_text(text)
        self.client = Client(config, namespace=self.namespace)
        self.names: set[str] = set()
        if config.namespace != self.namespace:
            import yaml

            doc = yaml.safe_load(text)
            for ctx in doc.get("contexts", []):
                if ctx["name"] == doc.get("current-context"):
                    ctx["context"]["namespace"] = self.namespace
            self.kubeconfig.write_text(yaml.safe_dump(doc))

    def lease(self, name: str) -> dict[str, Any] | None:
        from lightkube import ApiError
        from lightkube.resources.coordination_v1 import Lease

        self.names.add(name)
        try:
            return self.client.get(Lease, name, namespace=self.namespace).to_dict()
        except ApiError as exc:
            if exc.status.code == 404:
                return None
            raise

    def clean(self, roots: list[Path]) -> None:
        from lightkube import ApiError
        from lightkube.resources.coordination_v1 import Lease

        for root in roots:
            vid = root / ".ckptd" / "volume-id"
            if vid.is_file():
                self.names.add(f"ckptd-{vid.read_text().strip()}")
        for name in self.names:
            try:
                self.client.delete(Lease, name, namespace=self.namespace)
            except ApiError:
                pass


@pytest.fixture
def kube(tmp_path):
    assert KUBECONFIG is not None
    (tmp_path / "kube").mkdir()
    server = RealKube(Path(KUBECONFIG), tmp_path / "kube")
    try:
        yield server
    finally:
        server.clean([tmp_path, tmp_path / "vol"])
