//! actions/cache@v4 for the tests: its steps over the real `@actions/cache` client,
//! bundled by scripts/install node-peers, mirrored into a test Gitea as `actions/cache`.

use testkit::gitea::{Gitea, GiteaOptions};

/// Gitea on `bind` (where environments reach it) where `uses: OWNER/NAME` resolves to
/// itself, with the cache action mirrored as actions/cache@v4.
pub async fn gitea_with_it(bind: std::net::IpAddr) -> Gitea {
    let gitea = Gitea::start(GiteaOptions { bind, actions_settings: vec![("DEFAULT_ACTIONS_URL".into(), "self".into())], ..GiteaOptions::default() }).await;
    let action = gitea.create_org_repo("actions", "cache").await;
    let dist = testkit::peers_cache().join("node/cache-action/dist");
    let source = crate::paths::repository().join("tests/e2e/actions/cache");
    gitea.commit_file(&action, "main", "action.yml", &std::fs::read(source.join("action.yml")).unwrap()).await;
    for step in ["restore", "save"] {
        let bundle = std::fs::read(dist.join(step).join("index.js"))
            .unwrap_or_else(|e| panic!("{}: {e}: run scripts/install test-peers (scripts/install node-peers builds it)", dist.display()));
        gitea.commit_file(&action, "main", &format!("dist/{step}/index.js"), &bundle).await;
    }
    gitea.create_tag(&action, "v4").await;
    gitea
}
