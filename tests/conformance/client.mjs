// Connect conformance peer: the OFFICIAL Connect client for Node
// (@connectrpc/connect-node, HTTP/1.1) running the CASES of README.md.
//
//   node tests/conformance/client.mjs <baseUrl> <proto|json>
//   e.g. node tests/conformance/client.mjs http://127.0.0.1:1234/api/actions proto
//
// Prints `ok <case> (<codec>)` or `not ok <case> (<codec>): <reason>` per case;
// exits 0 only when every case passed. Needs ./gen
// (tests/conformance/generate tests/conformance/gen).
import { isDeepStrictEqual, inspect } from "node:util";
import { create, equals, toJson } from "@bufbuild/protobuf";
import { Code, ConnectError, createClient } from "@connectrpc/connect";
import { createConnectTransport } from "@connectrpc/connect-node";
import { RunnerService } from "./gen/runner/v1/services_pb.js";
import {
  DeclareResponseSchema,
  FetchTaskResponseSchema,
  RegisterResponseSchema,
  Result,
  RunnerStatus,
  TaskSchema,
  UpdateLogResponseSchema,
  UpdateTaskResponseSchema,
} from "./gen/runner/v1/messages_pb.js";
import { PingService } from "./gen/ping/v1/services_pb.js";

const [baseUrl, codec] = process.argv.slice(2);
if (!baseUrl || (codec !== "proto" && codec !== "json") || process.argv.length !== 4) {
  process.stderr.write("usage: node client.mjs <baseUrl> <proto|json>\n");
  process.exit(2);
}

const transport = createConnectTransport({
  baseUrl,
  httpVersion: "1.1",
  useBinaryFormat: codec === "proto",
});
const runner = createClient(RunnerService, transport);
const ping = createClient(PingService, transport);

const AUTH = { "x-runner-uuid": "conformance-uuid", "x-runner-token": "conformance-token" };

// ---- expected values (FIXTURE of README.md) --------------------------------

const WORKFLOW =
  "name: ci\non: push\njobs:\n  build:\n    runs-on: [self-hosted, container, docker]\n" +
  "    steps:\n      - run: echo héllo\n";

const FIXTURE_CONTEXT = {
  repository: "owner/repo",
  run_number: "7",
  run_attempt: 1,
  event: { ref: "refs/heads/main", forced: false },
  tags: ["a", 2.5, null],
  token: "",
};

const FIXTURE_TASK = {
  id: 9007199254740993n,
  workflowPayload: new TextEncoder().encode(WORKFLOW),
  context: FIXTURE_CONTEXT,
  secrets: { GITEA_TOKEN: "task-token", EMPTY: "" },
  vars: { V: "1" },
  needs: { prep: { outputs: { out: "x" }, result: Result.SUCCESS } },
};

// google.protobuf.Timestamp from an RFC 3339 string, exact to the nanosecond.
function ts(rfc3339) {
  const m = /^(.*?)(?:\.(\d{1,9}))?Z$/.exec(rfc3339);
  const ms = m ? Date.parse(m[1] + "Z") : NaN;
  if (Number.isNaN(ms) || ms % 1000 !== 0) throw new Error(`bad timestamp ${rfc3339}`);
  return { seconds: BigInt(ms / 1000), nanos: Number((m[2] ?? "").padEnd(9, "0")) };
}

// ---- assertions ------------------------------------------------------------

class Mismatch extends Error {}

function show(v) {
  return inspect(v, { depth: null, breakLength: Infinity, compact: true });
}

function expectEq(what, actual, expected) {
  // Strict: types matter (bigint vs number, Uint8Array vs string, null vs undefined).
  if (!isDeepStrictEqual(actual, expected)) {
    throw new Mismatch(`${what}: got ${show(actual)}, want ${show(expected)}`);
  }
}

// Whole-message equality against create(schema, expectedInit): every field,
// including the ones that must stay at their default.
function expectMessage(what, schema, actual, expectedInit) {
  const expected = create(schema, expectedInit);
  if (!equals(schema, actual, expected)) {
    const opts = { alwaysEmitImplicit: true };
    throw new Mismatch(
      `${what}: got ${JSON.stringify(toJson(schema, actual, opts))}, ` +
        `want ${JSON.stringify(toJson(schema, expected, opts))}`,
    );
  }
}

async function expectError(what, promise, code, rawMessage) {
  let err;
  try {
    const res = await promise;
    throw new Mismatch(`${what}: expected error ${Code[code]}, got response ${show(res)}`);
  } catch (e) {
    if (e instanceof Mismatch) throw e;
    err = ConnectError.from(e);
  }
  if (err.code !== code) {
    throw new Mismatch(
      `${what}: error code ${Code[err.code] ?? err.code}, want ${Code[code]} (message ${JSON.stringify(err.rawMessage)})`,
    );
  }
  if (rawMessage !== undefined && err.rawMessage !== rawMessage) {
    throw new Mismatch(`${what}: error message ${JSON.stringify(err.rawMessage)}, want ${JSON.stringify(rawMessage)}`);
  }
  return err;
}

// ---- cases -----------------------------------------------------------------

const cases = [
  [
    "ping",
    async () => {
      const res = await ping.ping({ data: "conformance" });
      expectEq("data", res.data, "Hello, conformance!");
    },
  ],

  [
    "register",
    async () => {
      const res = await runner.register({
        name: "runner-1",
        token: "registration-token",
        version: "v9",
        labels: ["self-hosted", "container"],
        ephemeral: true,
        capabilities: ["cancelling"],
      });
      const r = res.runner;
      if (r === undefined) throw new Mismatch("runner: missing");
      expectEq("runner.id", r.id, 1n);
      expectEq("runner.uuid", r.uuid, "conformance-uuid");
      expectEq("runner.token", r.token, "conformance-token");
      expectEq("runner.name", r.name, "runner-1");
      expectEq("runner.version", r.version, "v9");
      expectEq("runner.labels", r.labels, ["self-hosted", "container"]);
      expectEq("runner.ephemeral", r.ephemeral, true);
      expectEq("runner.status", r.status, RunnerStatus.IDLE);
      expectMessage("response", RegisterResponseSchema, res, {
        runner: {
          id: 1n,
          uuid: "conformance-uuid",
          token: "conformance-token",
          name: "runner-1",
          version: "v9",
          labels: ["self-hosted", "container"],
          ephemeral: true,
          status: RunnerStatus.IDLE,
        },
      });
    },
  ],

  [
    "register-bad-token",
    async () => {
      await expectError(
        "Register",
        runner.register({ name: "runner-1", token: "nope", version: "v9" }),
        Code.PermissionDenied,
        "runner registration token not found",
      );
    },
  ],

  [
    "declare",
    async () => {
      const res = await runner.declare(
        { version: "v9", labels: ["self-hosted"], capabilities: ["cancelling"] },
        { headers: AUTH },
      );
      const r = res.runner;
      if (r === undefined) throw new Mismatch("runner: missing");
      expectEq("runner.name", r.name, "conformance");
      expectEq("runner.version", r.version, "v9");
      expectEq("runner.labels", r.labels, ["self-hosted"]);
      expectEq("runner.status", r.status, RunnerStatus.ACTIVE);
      expectMessage("response", DeclareResponseSchema, res, {
        runner: {
          id: 1n,
          uuid: "conformance-uuid",
          name: "conformance",
          version: "v9",
          labels: ["self-hosted"],
          status: RunnerStatus.ACTIVE,
        },
      });
    },
  ],

  [
    "fetch-task",
    async () => {
      const res = await runner.fetchTask({ tasksVersion: 0n }, { headers: AUTH });
      expectEq("tasks_version", res.tasksVersion, 7n);
      const t = res.task;
      if (t === undefined) throw new Mismatch("task: missing");
      expectEq("task.id", t.id, 9007199254740993n);
      if (!(t.workflowPayload instanceof Uint8Array)) throw new Mismatch("task.workflow_payload: missing");
      // As text first (readable diff), then byte for byte.
      expectEq("task.workflow_payload (as UTF-8)", new TextDecoder().decode(t.workflowPayload), WORKFLOW);
      expectEq("task.workflow_payload", t.workflowPayload, FIXTURE_TASK.workflowPayload);
      // Struct compared structurally: numbers as numbers, null as null.
      expectEq("task.context", t.context, FIXTURE_CONTEXT);
      expectEq("task.secrets", t.secrets, { GITEA_TOKEN: "task-token", EMPTY: "" });
      expectEq("task.vars", t.vars, { V: "1" });
      expectEq("task.needs keys", Object.keys(t.needs), ["prep"]);
      expectEq("task.needs.prep.outputs", t.needs.prep.outputs, { out: "x" });
      expectEq("task.needs.prep.result", t.needs.prep.result, Result.SUCCESS);
      expectEq("task.machine", t.machine, "");
      expectMessage("task", TaskSchema, t, FIXTURE_TASK);
      expectMessage("response", FetchTaskResponseSchema, res, { task: FIXTURE_TASK, tasksVersion: 7n });
    },
  ],

  [
    "fetch-empty",
    async () => {
      const res = await runner.fetchTask({ tasksVersion: 7n }, { headers: AUTH });
      expectEq("task", res.task, undefined);
      expectEq("tasks_version", res.tasksVersion, 7n);
      expectMessage("response", FetchTaskResponseSchema, res, { tasksVersion: 7n });
    },
  ],

  [
    "update-task",
    async () => {
      const state = {
        id: 12n,
        result: Result.SUCCESS,
        startedAt: ts("2026-11-29T08:00:00.500Z"),
        stoppedAt: ts("2026-11-29T08:01:02Z"),
        steps: [
          {
            id: 0n,
            result: Result.SUCCESS,
            startedAt: ts("2026-11-29T08:00:01Z"),
            stoppedAt: ts("2026-11-29T08:01:00Z"),
            logIndex: 0n,
            logLength: 3n,
          },
        ],
      };
      const res = await runner.updateTask({ state, outputs: { b: "2", a: "1" } }, { headers: AUTH });
      const s = res.state;
      if (s === undefined) throw new Mismatch("state: missing");
      expectEq("state.id", s.id, 12n);
      expectEq("state.result", s.result, Result.SUCCESS);
      expectEq("state.started_at.seconds", s.startedAt?.seconds, 1795939200n);
      expectEq("state.started_at.nanos", s.startedAt?.nanos, 500000000);
      expectEq("state.stopped_at.seconds", s.stoppedAt?.seconds, 1795939262n);
      expectEq("state.stopped_at.nanos", s.stoppedAt?.nanos, 0);
      expectEq("state.steps.length", s.steps.length, 1);
      expectEq("state.steps[0].id", s.steps[0].id, 0n);
      expectEq("state.steps[0].result", s.steps[0].result, Result.SUCCESS);
      expectEq("state.steps[0].started_at.seconds", s.steps[0].startedAt?.seconds, 1795939201n);
      expectEq("state.steps[0].stopped_at.seconds", s.steps[0].stoppedAt?.seconds, 1795939260n);
      expectEq("state.steps[0].log_index", s.steps[0].logIndex, 0n);
      expectEq("state.steps[0].log_length", s.steps[0].logLength, 3n);
      expectEq("sent_outputs", res.sentOutputs, ["a", "b"]);
      expectMessage("response", UpdateTaskResponseSchema, res, { state, sentOutputs: ["a", "b"] });
    },
  ],

  [
    "update-task-cancelled",
    async () => {
      const res = await runner.updateTask({ state: { id: 13n } }, { headers: AUTH });
      if (res.state === undefined) throw new Mismatch("state: missing");
      expectEq("state.id", res.state.id, 13n);
      expectEq("state.result", res.state.result, Result.CANCELLED);
      expectMessage("response", UpdateTaskResponseSchema, res, {
        state: { id: 13n, result: Result.CANCELLED },
        sentOutputs: [],
      });
    },
  ],

  [
    "update-log",
    async () => {
      const res = await runner.updateLog(
        {
          taskId: 12n,
          index: 5n,
          rows: [
            { time: ts("2026-11-29T08:00:02Z"), content: "line 1" },
            { time: ts("2026-11-29T08:00:03Z"), content: "" },
          ],
          noMore: true,
        },
        { headers: AUTH },
      );
      expectEq("ack_index", res.ackIndex, 7n);
      expectMessage("response", UpdateLogResponseSchema, res, { ackIndex: 7n });
    },
  ],

  [
    "unauthenticated",
    async () => {
      await expectError(
        "Declare",
        runner.declare(
          { version: "v9", labels: ["self-hosted"], capabilities: ["cancelling"] },
          { headers: { "x-runner-uuid": "conformance-uuid", "x-runner-token": "wrong" } },
        ),
        Code.Unauthenticated,
        "unregistered runner",
      );
    },
  ],

  [
    "deadline",
    async () => {
      const started = performance.now();
      await expectError(
        "FetchTask{99}",
        runner.fetchTask({ tasksVersion: 99n }, { headers: AUTH, timeoutMs: 200 }),
        Code.DeadlineExceeded,
      );
      const elapsed = performance.now() - started;
      if (elapsed >= 2000) {
        throw new Mismatch(`call took ${Math.round(elapsed)} ms, want < 2000 ms`);
      }
    },
  ],
];

// Sanity check of the helper itself: the fixture timestamps used above.
expectEq("ts()", ts("2026-11-29T08:00:00.500Z"), { seconds: 1795939200n, nanos: 500000000 });

let failed = 0;
for (const [name, run] of cases) {
  try {
    await run();
    process.stdout.write(`ok ${name} (${codec})\n`);
  } catch (e) {
    failed++;
    const reason =
      e instanceof Mismatch
        ? e.message
        : e instanceof ConnectError
          ? `unexpected error ${Code[e.code]}: ${e.rawMessage}`
          : String(e?.stack ?? e);
    process.stdout.write(`not ok ${name} (${codec}): ${reason.replace(/\n/g, " | ")}\n`);
  }
}
process.exit(failed === 0 ? 0 : 1);
