// The main step of actions/cache@v4 (its restoreImpl): restore by key and restore keys,
// the output cache-hit only for an exact match, the key kept for the post step.
const core = require("@actions/core");
const cache = require("@actions/cache");

const inputList = (name) =>
  core.getInput(name).split("\n").map((line) => line.trim()).filter((line) => line !== "");
const isExact = (matched, key) => !!matched && matched.localeCompare(key, undefined, { sensitivity: "accent" }) === 0;

async function run() {
  try {
    if (!cache.isFeatureAvailable()) {
      core.info("[warning]An internal error has occurred in cache backend. Please check https://www.githubstatus.com/ for any ongoing issue in actions.");
      core.setOutput("cache-hit", "false");
      return;
    }
    if (!process.env.GITHUB_REF) {
      core.info(`[warning]Event Validation Error: The event type ${process.env.GITHUB_EVENT_NAME} is not supported because it's not tied to a branch or tag ref.`);
      return;
    }
    const key = core.getInput("key", { required: true });
    core.saveState("CACHE_KEY", key);
    const restoreKeys = inputList("restore-keys");
    const paths = inputList("path");
    const enableCrossOsArchive = core.getInput("enableCrossOsArchive") === "true";
    const failOnCacheMiss = core.getInput("fail-on-cache-miss") === "true";
    const lookupOnly = core.getInput("lookup-only") === "true";
    const matched = await cache.restoreCache(paths, key, restoreKeys, { lookupOnly }, enableCrossOsArchive);
    if (!matched) {
      if (failOnCacheMiss) {
        throw new Error(`Failed to restore cache entry. Exiting as fail-on-cache-miss is set. Input key: ${key}`);
      }
      core.info(`Cache not found for input keys: ${[key, ...restoreKeys].join(", ")}`);
      return;
    }
    core.saveState("CACHE_RESULT", matched);
    core.setOutput("cache-hit", isExact(matched, key).toString());
    core.info(lookupOnly ? `Cache found and can be restored from key: ${matched}` : `Cache restored from key: ${matched}`);
  } catch (error) {
    core.setFailed(error.message);
  }
}

run();
