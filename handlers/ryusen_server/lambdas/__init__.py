"""The Lambda handlers: thin adapters from Lambda's events to the engine (engineering.md).

A success writes no log line: every step passes through these functions, and CloudWatch Logs bills each byte.
Lambda's own metrics (Invocations, Errors, Throttles) and SQS's and API Gateway's count the requests; the
functions log and publish a metric only for what those cannot see (a dispatch failure reported as a batch item,
a blocked run's age, a refused or failed request)."""

import warnings

# Powertools warns on every invocation that publishes no metric, which is every successful one here.
warnings.filterwarnings("ignore", message="No application metrics to publish", category=UserWarning)
