//! The document built from JSON instead of a pickle: objects become dicts with string keys,
//! arrays lists.

use super::{Document, Node, NodeId};
use std::borrow::Cow;
use std::fmt;

impl Document<'_> {
    /// The same structure from JSON: objects become dicts with string keys, arrays lists.
    pub fn from_json(value: &serde_json::Value) -> Document<'static> {
        let mut doc = Document {
            nodes: Vec::new(),
            root: 0,
        };
        doc.root = doc.push_json(value);
        doc
    }

    /// The same structure read straight from JSON text, without a `serde_json::Value` in
    /// between (which would cost several times the input): each value becomes its node as it
    /// is read. Nesting is limited by serde_json (128 levels); object keys keep their order,
    /// duplicates included.
    pub fn from_json_bytes(bytes: &[u8]) -> Result<Document<'static>, serde_json::Error> {
        use serde::de::DeserializeSeed;
        let mut doc = Document {
            nodes: Vec::new(),
            root: 0,
        };
        let mut deserializer = serde_json::Deserializer::from_slice(bytes);
        doc.root = JsonNode(&mut doc.nodes).deserialize(&mut deserializer)?;
        deserializer.end()?;
        Ok(doc)
    }

    fn push_json(&mut self, value: &serde_json::Value) -> NodeId {
        use serde_json::Value;
        let node = match value {
            Value::Null => Node::None,
            Value::Bool(b) => Node::Bool(*b),
            Value::Number(n) => match (n.as_i64(), n.as_u64()) {
                (Some(i), _) => Node::Int(i128::from(i)),
                (None, Some(u)) => Node::Int(i128::from(u)),
                _ => Node::Float(n.as_f64().unwrap_or(f64::NAN)),
            },
            Value::String(s) => Node::Str(Cow::Owned(s.clone())),
            Value::Array(items) => Node::List(items.iter().map(|v| self.push_json(v)).collect()),
            Value::Object(map) => Node::Dict(
                map.iter()
                    .map(|(k, v)| {
                        let key = self.push_json(&Value::String(k.clone()));
                        (key, self.push_json(v))
                    })
                    .collect(),
            ),
        };
        // serde_json nests at most 128 levels and its input bounds the node count.
        self.nodes.push(node);
        (self.nodes.len() - 1) as NodeId
    }
}

/// Reads one JSON value into the arena and gives its node (serde's seed for
/// [`Document::from_json_bytes`]).
struct JsonNode<'n>(&'n mut Vec<Node<'static>>);

impl JsonNode<'_> {
    fn push<E: serde::de::Error>(self, node: Node<'static>) -> Result<NodeId, E> {
        let id = NodeId::try_from(self.0.len())
            .map_err(|_| E::custom("more values than this reader can hold"))?;
        self.0.push(node);
        Ok(id)
    }
}

impl<'de> serde::de::DeserializeSeed<'de> for JsonNode<'_> {
    type Value = NodeId;

    fn deserialize<D: serde::Deserializer<'de>>(self, deserializer: D) -> Result<NodeId, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for JsonNode<'_> {
    type Value = NodeId;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_unit<E: serde::de::Error>(self) -> Result<NodeId, E> {
        self.push(Node::None)
    }

    fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<NodeId, E> {
        self.push(Node::Bool(v))
    }

    fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<NodeId, E> {
        self.push(Node::Int(i128::from(v)))
    }

    fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<NodeId, E> {
        self.push(Node::Int(i128::from(v)))
    }

    fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<NodeId, E> {
        self.push(Node::Float(v))
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<NodeId, E> {
        self.push(Node::Str(Cow::Owned(v.to_owned())))
    }

    fn visit_string<E: serde::de::Error>(self, v: String) -> Result<NodeId, E> {
        self.push(Node::Str(Cow::Owned(v)))
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<NodeId, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element_seed(JsonNode(self.0))? {
            items.push(item);
        }
        self.push(Node::List(items))
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<NodeId, A::Error> {
        let mut entries = Vec::new();
        while let Some(key) = map.next_key::<String>()? {
            let key = JsonNode(self.0).push(Node::Str(Cow::Owned(key)))?;
            let value = map.next_value_seed(JsonNode(self.0))?;
            entries.push((key, value));
        }
        self.push(Node::Dict(entries))
    }
}
