// The post step of actions/cache@v4 (its saveImpl): save under the key unless the main
// step restored exactly it; a save that cannot be made is said, never a failure.
const core = require("@actions/core");
const cache = require("@actions/cache");

const inputList = (name) =>
  core.getInput(name).split("\n").map((line) => line.trim()).filter((line) => line !== "");
const isExact = (matched, key) => !!matched && matched.localeCompare(key, undefined, { sensitivity: "accent" }) === 0;

async function run() {
  try {
    if (!cache.isFeatureAvailable()) {
      return;
    }
    const key = core.getState("CACHE_KEY") || core.getInput("key");
    if (!key) {
      core.info("[warning]Key is not specified.");
      return;
    }
    if (isExact(core.getState("CACHE_RESULT"), key)) {
      core.info(`Cache hit occurred on the primary key ${key}, not saving cache.`);
      return;
    }
    const chunk = Number.parseInt(core.getInput("upload-chunk-size") || "", 10);
    const enableCrossOsArchive = core.getInput("enableCrossOsArchive") === "true";
    const id = await cache.saveCache(inputList("path"), key, { uploadChunkSize: Number.isNaN(chunk) ? undefined : chunk }, enableCrossOsArchive);
    if (id !== -1) {
      core.info(`Cache saved with key: ${key}`);
    }
  } catch (error) {
    core.info(`[warning]${error.message}`);
  }
}

run();
