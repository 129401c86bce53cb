//! Which metadata contexts a LIST_META_CONTEXT lists and a SET_META_CONTEXT selects for
//! the client's queries (the rules are in the `handshake` module doc). A context whose
//! subject (another export it describes) the connection's registry may not open is neither
//! listed nor selected, as if it did not exist.

use std::collections::BTreeSet;

use super::{ContextSource, CONTEXTS_SELECTED_MAX};
use crate::export::{Export, ExportRegistry};
use crate::protocol::{self, BASE_ALLOCATION};

/// Whether `name` may come from an export as a context of its own: `namespace:leaf` with a
/// namespace other than `base`, within the protocol's string limit.
fn is_export_context_name(name: &str) -> bool {
    match name.split_once(':') {
        Some((namespace, _)) => {
            !namespace.is_empty()
                && namespace != "base"
                && name.len() <= protocol::STRING_LENGTH_MAX
                && !name.contains('\0')
        }
        None => false,
    }
}

/// The contexts NBD_OPT_LIST_META_CONTEXT answers for `queries` (see the module docs), each
/// once, in the order found.
/// Whether the connection may see `name`: its subject, if any, is an export the connection
/// may open.
fn visible(export: &dyn Export, registry: &dyn ExportRegistry, name: &str) -> bool {
    export
        .meta_context_subject(name)
        .is_none_or(|subject| registry.may_open(&subject))
}

pub(super) fn listed_contexts(
    export: &dyn Export,
    registry: &dyn ExportRegistry,
    queries: &[String],
) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    let mut seen: BTreeSet<String> = BTreeSet::new();
    let mut add = |name: String, names: &mut Vec<String>| {
        if seen.insert(name.clone()) {
            names.push(name);
        }
    };
    let everything = [String::new()];
    let queries = if queries.is_empty() {
        &everything[..]
    } else {
        queries
    };
    for query in queries {
        let wildcard = query.is_empty() || query.ends_with(':');
        if (wildcard && BASE_ALLOCATION.starts_with(query.as_str())) || query == BASE_ALLOCATION {
            add(BASE_ALLOCATION.to_owned(), &mut names);
        }
        if query.starts_with("base:") {
            continue;
        }
        for name in export.meta_contexts(query) {
            let matches = if wildcard {
                name.starts_with(query.as_str())
            } else {
                name == *query
            };
            if matches && is_export_context_name(&name) && visible(export, registry, &name) {
                add(name, &mut names);
            }
        }
    }
    names
}

/// The contexts NBD_OPT_SET_META_CONTEXT selects for `queries`, each once; `Err` if they
/// are more than [`CONTEXTS_SELECTED_MAX`].
pub(super) fn selected_contexts(
    export: &dyn Export,
    registry: &dyn ExportRegistry,
    queries: &[String],
) -> std::result::Result<Vec<(String, ContextSource)>, ()> {
    let mut names: Vec<&str> = Vec::new();
    let mut seen: BTreeSet<&str> = BTreeSet::new();
    for query in queries {
        let exact = query == BASE_ALLOCATION || is_export_context_name(query);
        if exact && !query.ends_with(':') && seen.insert(query.as_str()) {
            names.push(query);
        }
    }
    let mut chosen = Vec::new();
    for name in names {
        let source = if name == BASE_ALLOCATION {
            ContextSource::BaseAllocation
        } else if !visible(export, registry, name) {
            continue;
        } else {
            match export.meta_context(name) {
                Some(context) => ContextSource::Export(context),
                None => continue,
            }
        };
        if chosen.len() == CONTEXTS_SELECTED_MAX {
            return Err(());
        }
        chosen.push((name.to_owned(), source));
    }
    Ok(chosen)
}
