//! The assignment model: everything derived from one Gitea task, without side effects —
//! where it runs ([`placement`]), who it is ([`identity`]), how it is stored
//! ([`envelope`]), how its environment authenticates ([`capability`]) and what its job
//! may reach: its cache scope and runtime tokens ([`context`]). Other
//! components read these; nothing here touches the store, Gitea or a driver.

pub mod capability;
pub mod context;
pub mod envelope;
pub mod identity;
pub mod placement;

pub use envelope::Assignment;
pub use placement::Placement;

/// What derivation depends on besides the task: the trust domain of identities and
/// the label policy of placements. Changing either makes stored envelopes of live
/// assignments underivable (detected, never silently re-placed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rules {
    pub trust_domain: String,
    pub labels: placement::LabelPolicy,
}
