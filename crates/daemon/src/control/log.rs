//! The log line of a management operation: what was asked (the request's wire form, so a new
//! request kind is logged without a change here), on which volume, and how it ended.

use super::{OpError, Outcome, Request};

/// Logs one management operation and its result: info when done or refused, since a
/// refusal is the pool answering a request, not a fault of the server.
pub(super) fn management(request: &Request, result: &Result<Outcome, OpError>) {
    let mut fields = match serde_json::to_value(request) {
        Ok(serde_json::Value::Object(fields)) => fields,
        _ => serde_json::Map::new(),
    };
    let operation = fields
        .remove("op")
        .and_then(|op| op.as_str().map(str::to_string))
        .unwrap_or_else(|| "unknown".to_string());
    let volume = fields
        .remove("name")
        .and_then(|name| name.as_str().map(str::to_string));
    let arguments = serde_json::Value::Object(fields).to_string();
    match result {
        Ok(_) => tracing::info!(
            operation = %operation,
            volume = volume.as_deref(),
            arguments = %arguments,
            "management operation done"
        ),
        Err(error) => tracing::info!(
            operation = %operation,
            volume = volume.as_deref(),
            arguments = %arguments,
            %error,
            "management operation refused"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The request's wire form names the operation and the volume for every kind.
    #[test]
    fn wire_form_names_operation_and_volume() {
        let request = Request::ResizeVolume {
            name: "vm".to_string(),
            size_bytes: 4096,
            force: false,
        };
        let value = serde_json::to_value(&request).unwrap();
        assert_eq!(value["op"], "resize_volume");
        assert_eq!(value["name"], "vm");
    }
}
