//! The two Connect unary codecs: binary protobuf (`application/proto`) and the
//! proto3 JSON mapping (`application/json`).
//!
//! JSON goes through prost-reflect's dynamic messages, which implement the canonical
//! proto3 JSON mapping (lowerCamelCase names, 64-bit integers as strings, enums by
//! name, RFC 3339 timestamps, Struct as plain JSON). The generated prost types carry
//! their full protobuf name (`prost::Name`), which selects the descriptor.

use bytes::Bytes;
use prost::Message as _;
use prost_reflect::{DescriptorPool, DeserializeOptions, DynamicMessage, SerializeOptions};

/// A message the Connect layer can carry with either codec.
pub trait Message: prost::Message + prost::Name + Default + Send + Sync + 'static {}
impl<T: prost::Message + prost::Name + Default + Send + Sync + 'static> Message for T {}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Codec {
    Proto,
    Json,
}

/// Why a message could not be encoded or decoded.
#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    #[error("message type {0} is not in the descriptor pool")]
    UnknownMessage(String),
    #[error("invalid protobuf for {message}")]
    Protobuf {
        message: String,
        #[source]
        source: prost::DecodeError,
    },
    #[error("invalid JSON for {message}")]
    Json {
        message: String,
        #[source]
        source: serde_json::Error,
    },
}

impl Codec {
    /// The content type of a unary request or success response.
    pub fn content_type(self) -> &'static str {
        match self {
            Codec::Proto => "application/proto",
            Codec::Json => "application/json",
        }
    }

    /// The codec of a unary Connect content type. Accepts what connect-go accepts:
    /// `application/proto`, `application/json` and `application/json; charset=utf-8`
    /// (case-insensitive, with optional white space).
    pub fn from_content_type(value: &str) -> Option<Codec> {
        let mut parts = value.split(';');
        let media = parts.next()?.trim().to_ascii_lowercase();
        let params: Vec<String> = parts.map(|p| p.trim().to_ascii_lowercase().replace(' ', "")).filter(|p| !p.is_empty()).collect();
        match (media.as_str(), params.as_slice()) {
            ("application/proto", []) => Some(Codec::Proto),
            ("application/json", []) => Some(Codec::Json),
            ("application/json", [charset]) if charset == "charset=utf-8" => Some(Codec::Json),
            _ => None,
        }
    }

    /// # Errors
    /// Only for JSON, when the message type is missing from `pool`.
    pub fn encode<M: Message>(self, message: &M, pool: &DescriptorPool) -> Result<Bytes, CodecError> {
        match self {
            Codec::Proto => Ok(Bytes::from(message.encode_to_vec())),
            Codec::Json => {
                let descriptor = descriptor::<M>(pool)?;
                let dynamic = DynamicMessage::decode(descriptor, message.encode_to_vec().as_slice())
                    .map_err(|source| CodecError::Protobuf { message: M::full_name(), source })?;
                let mut out = Vec::new();
                let mut serializer = serde_json::Serializer::new(&mut out);
                dynamic
                    .serialize_with_options(&mut serializer, &SerializeOptions::new())
                    .map_err(|source| CodecError::Json { message: M::full_name(), source })?;
                Ok(Bytes::from(out))
            }
        }
    }

    /// # Errors
    /// When `bytes` is not a valid encoding of `M`.
    pub fn decode<M: Message>(self, bytes: &[u8], pool: &DescriptorPool) -> Result<M, CodecError> {
        match self {
            Codec::Proto => M::decode(bytes).map_err(|source| CodecError::Protobuf { message: M::full_name(), source }),
            Codec::Json => {
                let descriptor = descriptor::<M>(pool)?;
                let mut deserializer = serde_json::Deserializer::from_slice(bytes);
                // connect-go discards unknown JSON fields, so newer peers can add fields.
                let options = DeserializeOptions::new().deny_unknown_fields(false);
                let json_error = |source| CodecError::Json { message: M::full_name(), source };
                let dynamic = DynamicMessage::deserialize_with_options(descriptor, &mut deserializer, &options).map_err(json_error)?;
                deserializer.end().map_err(json_error)?;
                M::decode(dynamic.encode_to_vec().as_slice()).map_err(|source| CodecError::Protobuf { message: M::full_name(), source })
            }
        }
    }
}

fn descriptor<M: Message>(pool: &DescriptorPool) -> Result<prost_reflect::MessageDescriptor, CodecError> {
    let name = M::full_name();
    pool.get_message_by_name(&name).ok_or(CodecError::UnknownMessage(name))
}

#[cfg(test)]
mod tests {
    use proto::runner::v1::{FetchTaskRequest, LogRow, Task, UpdateLogRequest};

    use super::*;

    #[test]
    fn content_types() {
        let table: &[(&str, Option<Codec>)] = &[
            ("application/proto", Some(Codec::Proto)),
            ("application/json", Some(Codec::Json)),
            ("application/json; charset=utf-8", Some(Codec::Json)),
            ("Application/JSON;charset=UTF-8", Some(Codec::Json)),
            ("application/json; charset=latin1", None),
            ("application/proto; charset=utf-8", None),
            ("application/connect+proto", None),
            ("application/grpc", None),
            ("text/plain", None),
            ("", None),
        ];
        for &(value, want) in table {
            assert_eq!(Codec::from_content_type(value), want, "{value:?}");
        }
    }

    #[test]
    fn json_uses_the_proto3_mapping() {
        let pool = proto::descriptor_pool();
        let request = UpdateLogRequest {
            task_id: 9_007_199_254_740_993,
            index: 5,
            rows: vec![LogRow { time: Some(prost_types::Timestamp { seconds: 1_796_025_600, nanos: 500_000_000 }), content: "line".into() }],
            no_more: true,
        };
        let json = Codec::Json.encode(&request, pool).unwrap();
        let value: serde_json::Value = serde_json::from_slice(&json).unwrap();
        assert_eq!(
            value,
            serde_json::json!({
                "taskId": "9007199254740993",
                "index": "5",
                "rows": [{"time": "2026-11-30T08:00:00.500Z", "content": "line"}],
                "noMore": true
            })
        );
        let decoded: UpdateLogRequest = Codec::Json.decode(&json, pool).unwrap();
        assert_eq!(decoded, request);
    }

    #[test]
    fn json_accepts_numbers_snake_case_and_unknown_fields() {
        let pool = proto::descriptor_pool();
        for body in [r#"{"tasksVersion":"3"}"#, r#"{"tasksVersion":3}"#, r#"{"tasks_version":3}"#, r#"{"tasksVersion":3,"addedLater":{"x":1}}"#] {
            let decoded: FetchTaskRequest = Codec::Json.decode(body.as_bytes(), pool).unwrap();
            assert_eq!(decoded.tasks_version, 3, "{body}");
        }
    }

    #[test]
    fn malformed_bodies_are_errors() {
        let pool = proto::descriptor_pool();
        for body in [&b"{"[..], b"[]", b"{\"tasksVersion\":\"x\"}", b"{} trailing", b"\xff"] {
            assert!(Codec::Json.decode::<FetchTaskRequest>(body, pool).is_err(), "{body:?}");
        }
        // A truncated varint and a field with wire type 7 are not protobuf.
        for body in [&[0x08, 0xff][..], &[0x0f, 0x00]] {
            assert!(Codec::Proto.decode::<Task>(body, pool).is_err(), "{body:?}");
        }
    }
}
