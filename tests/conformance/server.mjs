// Connect conformance peer: the OFFICIAL Connect server for Node
// (@connectrpc/connect-node, HTTP/1.1) implementing the FIXTURE of README.md.
//
//   node tests/conformance/server.mjs
//
// Serves runner.v1.RunnerService and ping.v1.PingService under /api/actions
// (like Gitea) on 127.0.0.1, port chosen by the OS. Prints `LISTENING <port>`
// on stdout once it accepts connections. Exits when stdin reaches EOF (so the
// process dies with its parent) or on SIGTERM/SIGINT. Logs every request to
// stderr. Needs ./gen (tests/conformance/generate tests/conformance/gen).
import * as http from "node:http";
import { Code, ConnectError } from "@connectrpc/connect";
import { connectNodeAdapter } from "@connectrpc/connect-node";
import { RunnerService } from "./gen/runner/v1/services_pb.js";
import { Result, RunnerStatus } from "./gen/runner/v1/messages_pb.js";
import { PingService } from "./gen/ping/v1/services_pb.js";

const PREFIX = "/api/actions";
const UUID = "conformance-uuid";
const TOKEN = "conformance-token";
const REGISTRATION_TOKEN = "registration-token";

const WORKFLOW =
  "name: ci\non: push\njobs:\n  build:\n    runs-on: [self-hosted, container, docker]\n" +
  "    steps:\n      - run: echo héllo\n";

// FIXTURE_TASK (README.md). `machine` is left unset.
const FIXTURE_TASK = {
  id: 9007199254740993n, // 2^53 + 1: not representable as a JS number
  workflowPayload: new TextEncoder().encode(WORKFLOW),
  // google.protobuf.Struct fields are plain JSON objects in protobuf-es v2.
  context: {
    repository: "owner/repo",
    run_number: "7",
    run_attempt: 1,
    event: { ref: "refs/heads/main", forced: false },
    tags: ["a", 2.5, null],
    token: "",
  },
  secrets: { GITEA_TOKEN: "task-token", EMPTY: "" },
  vars: { V: "1" },
  needs: { prep: { outputs: { out: "x" }, result: Result.SUCCESS } },
};

function requireRunner(ctx) {
  const h = ctx.requestHeader;
  if (h.get("x-runner-uuid") !== UUID || h.get("x-runner-token") !== TOKEN) {
    throw new ConnectError("unregistered runner", Code.Unauthenticated);
  }
}

// Resolves after `ms`, or rejects as soon as `signal` aborts (client gone,
// or the deadline from Connect-Timeout-Ms passed).
function sleep(ms, signal) {
  return new Promise((resolve, reject) => {
    if (signal.aborted) {
      reject(signal.reason);
      return;
    }
    const onAbort = () => {
      clearTimeout(timer);
      reject(signal.reason);
    };
    const timer = setTimeout(() => {
      signal.removeEventListener("abort", onAbort);
      resolve();
    }, ms);
    signal.addEventListener("abort", onAbort, { once: true });
  });
}

function routes(router) {
  router.service(RunnerService, {
    register(req) {
      if (req.token !== REGISTRATION_TOKEN) {
        throw new ConnectError("runner registration token not found", Code.PermissionDenied);
      }
      return {
        runner: {
          id: 1n,
          uuid: UUID,
          token: TOKEN,
          name: req.name,
          version: req.version,
          labels: req.labels,
          ephemeral: req.ephemeral,
          status: RunnerStatus.IDLE,
        },
      };
    },

    declare(req, ctx) {
      requireRunner(ctx);
      return {
        runner: {
          id: 1n,
          uuid: UUID,
          name: "conformance",
          version: req.version,
          labels: req.labels,
          status: RunnerStatus.ACTIVE,
        },
      };
    },

    async fetchTask(req, ctx) {
      requireRunner(ctx);
      switch (req.tasksVersion) {
        case 0n:
          return { task: FIXTURE_TASK, tasksVersion: 7n };
        case 7n:
          return { tasksVersion: 7n };
        case 99n:
          await sleep(3000, ctx.signal);
          return { tasksVersion: 99n };
        default:
          return { tasksVersion: req.tasksVersion };
      }
    },

    updateTask(req, ctx) {
      requireRunner(ctx);
      const s = req.state;
      const outputs = Object.keys(req.outputs).sort();
      if (s === undefined) {
        return { sentOutputs: outputs };
      }
      return {
        state: {
          id: s.id,
          result: s.id === 13n ? Result.CANCELLED : s.result,
          startedAt: s.startedAt,
          stoppedAt: s.stoppedAt,
          steps: s.steps,
        },
        sentOutputs: outputs,
      };
    },

    updateLog(req, ctx) {
      requireRunner(ctx);
      return { ackIndex: req.index + BigInt(req.rows.length) };
    },
  });

  router.service(PingService, {
    ping(req) {
      return { data: `Hello, ${req.data}!` };
    },
  });
}

const handler = connectNodeAdapter({ routes, requestPathPrefix: PREFIX });

const server = http.createServer((req, res) => {
  const h = req.headers;
  const extra = ["connect-protocol-version", "connect-timeout-ms", "content-encoding", "accept-encoding"]
    .filter((k) => h[k] !== undefined)
    .map((k) => ` ${k}=${h[k]}`)
    .join("");
  process.stderr.write(
    `request ${req.method} ${req.url} HTTP/${req.httpVersion} content-type=${h["content-type"] ?? "-"}${extra}\n`,
  );
  // connect-node passes the response headers to writeHead() directly, so they
  // never show up in res.getHeader(): capture them on the way out.
  let sent = {};
  const writeHead = res.writeHead;
  res.writeHead = function (status, ...rest) {
    const hs = rest.find((a) => a !== null && typeof a === "object") ?? {};
    sent = Object.fromEntries(Object.entries(hs).map(([k, v]) => [k.toLowerCase(), v]));
    return writeHead.call(this, status, ...rest);
  };
  res.on("close", () => {
    const ct = sent["content-type"] ?? res.getHeader("content-type") ?? "-";
    const enc = sent["content-encoding"] ? ` content-encoding=${sent["content-encoding"]}` : "";
    const state = res.writableFinished ? "" : " (connection closed before the response was sent)";
    process.stderr.write(`response ${req.url} ${res.statusCode} content-type=${ct}${enc}${state}\n`);
  });
  handler(req, res);
});

let stopping = false;
function stop(why) {
  if (stopping) return;
  stopping = true;
  process.stderr.write(`server stopping: ${why}\n`);
  server.close();
  server.closeAllConnections?.();
  // Do not wait for anything (e.g. a pending FetchTask{99}).
  setTimeout(() => process.exit(0), 100).unref();
}

process.on("SIGTERM", () => stop("SIGTERM"));
process.on("SIGINT", () => stop("SIGINT"));
// The parent holds our stdin; when it exits (or closes the pipe), we go too.
process.stdin.on("end", () => stop("stdin closed"));
process.stdin.on("close", () => stop("stdin closed"));
process.stdin.on("error", () => stop("stdin error"));
process.stdin.resume();

server.listen(0, "127.0.0.1", () => {
  const { port } = server.address();
  process.stdout.write(`LISTENING ${port}\n`);
});
