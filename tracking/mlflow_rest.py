"""The few calls of MLflow's REST API (/api/2.0/mlflow/...) the network makes to a team's tracker,
over an httpx client the caller gives (tracking.worker gives one pinned by core.endpoints'
address policy). No Django here, and not the `mlflow` package: it pins many heavy packages and
the API is a handful of JSON calls.

Every failure is a TrackerError saying whether the request may have been applied all the same
(`unsure`): a refused connection or an answered 4xx was not; a request sent whose answer never
came (a timeout, a reset, a gateway's 5xx) may have been. The worker checks the run's history
before sending such a batch again.
"""

from collections.abc import Iterator, Sequence
from typing import Any

import httpx

ERROR_TEXT = 300  # characters of a tracker's error message kept for the team's page


class TrackerError(Exception):
    def __init__(self, message: str, unsure: bool = False, code: str = ""):
        super().__init__(message)
        self.unsure, self.code = unsure, code


class Mlflow:
    def __init__(self, client: httpx.Client, url: str, token: str = "", timeout: float = 10.0):
        self.client, self.base, self.timeout = client, url.rstrip("/") + "/api/2.0/mlflow/", timeout
        self.headers = {"Accept": "application/json", "User-Agent": "E31-Tracker/1"}
        if token:
            self.headers["Authorization"] = f"Bearer {token}"

    def call(self, method: str, path: str, body: dict[str, Any] | None = None, query: dict[str, Any] | None = None) -> dict[str, Any]:
        """The answer's JSON; TrackerError for anything but a 200 with JSON."""
        try:
            response = self.client.request(method, self.base + path, json=body, params=query, headers=self.headers, timeout=self.timeout)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as error:
            raise TrackerError(f"cannot reach the tracker: {type(error).__name__}: {error}"[:ERROR_TEXT]) from None
        except httpx.TimeoutException:
            raise TrackerError(f"the tracker did not answer within {self.timeout:g} s", unsure=True) from None
        except httpx.HTTPError as error:
            # Sent, at least in part, and then the connection failed: the server may have it.
            raise TrackerError(f"the connection to the tracker failed: {type(error).__name__}: {error}"[:ERROR_TEXT], unsure=True) from None
        if response.status_code == 200:
            try:
                answer = response.json()
            except ValueError:
                raise TrackerError("the tracker answered 200 with no JSON: is the URL an MLflow tracking server?") from None
            return answer if isinstance(answer, dict) else {}
        raise self.refusal(response)

    @staticmethod
    def refusal(response: httpx.Response) -> TrackerError:
        status = response.status_code
        try:
            answer = response.json()
        except ValueError:
            answer = {}
        answer = answer if isinstance(answer, dict) else {}
        code, message = str(answer.get("error_code", "")), str(answer.get("message", ""))
        if status in (401, 403):
            text = f"the tracker refused the token ({status})"
        elif 300 <= status < 400:
            text = f"the tracker answered {status}, a redirect (not followed): give its final address"
        else:
            text = f"the tracker answered {status}" + (f" {code}" if code else "") + (f": {message}" if message else "")
        # A 5xx may come from a proxy whose backend applied the request after all.
        return TrackerError(text[:ERROR_TEXT], unsure=status >= 500, code=code)

    # Experiments and runs ---------------------------------------------------------------------

    def experiment_id(self, name: str) -> str:
        """The id of the experiment named `name`, created if there is none."""
        try:
            found = self.call("GET", "experiments/get-by-name", query={"experiment_name": name})
        except TrackerError as error:
            if error.code != "RESOURCE_DOES_NOT_EXIST":
                raise
        else:
            experiment = found.get("experiment") or {}
            if experiment.get("lifecycle_stage") == "deleted":
                raise TrackerError(f"the experiment {name!r} is deleted in the tracker: restore it there, or delete it for good")
            return str(experiment["experiment_id"])
        try:
            return str(self.call("POST", "experiments/create", {"name": name})["experiment_id"])
        except TrackerError as error:
            if error.code != "RESOURCE_ALREADY_EXISTS":  # made meanwhile (another worker, a lost answer)
                raise
        return str(self.call("GET", "experiments/get-by-name", query={"experiment_name": name})["experiment"]["experiment_id"])

    def find_run(self, experiment_id: str, tag: str, value: str) -> str | None:
        """The id of the experiment's run with tag = value, or None."""
        query = f"tags.`{tag}` = '{value}'"  # value: a job id (a UUID), nothing to escape
        answer = self.call("POST", "runs/search", {"experiment_ids": [experiment_id], "filter": query, "max_results": 1})
        runs = answer.get("runs") or []
        return str(runs[0]["info"]["run_id"]) if runs else None

    def create_run(self, experiment_id: str, name: str, start_time: int, tags: dict[str, str]) -> str:
        body = {"experiment_id": experiment_id, "run_name": name, "start_time": start_time, "tags": pairs(tags)}
        return str(self.call("POST", "runs/create", body)["run"]["info"]["run_id"])

    def log_batch(self, run_id: str, metrics: Sequence[dict[str, Any]] = (), params: Sequence[dict[str, str]] = ()) -> None:
        self.call("POST", "runs/log-batch", {"run_id": run_id, "metrics": list(metrics), "params": list(params)})

    def set_tag(self, run_id: str, key: str, value: str) -> None:
        self.call("POST", "runs/set-tag", {"run_id": run_id, "key": key, "value": value})

    def end_run(self, run_id: str, status: str, end_time: int) -> None:
        self.call("POST", "runs/update", {"run_id": run_id, "status": status, "end_time": end_time})

    def history(self, run_id: str, key: str) -> Iterator[dict[str, Any]]:
        """Every stored point of the run's metric `key`, page by page."""
        token = ""
        while True:
            query = {"run_id": run_id, "metric_key": key, "max_results": 25000, **({"page_token": token} if token else {})}
            answer = self.call("GET", "metrics/get-history", query=query)
            yield from answer.get("metrics") or []
            token = answer.get("next_page_token") or ""
            if not token:
                return


def pairs(tags: dict[str, str]) -> list[dict[str, str]]:
    return [{"key": key, "value": value} for key, value in tags.items()]
