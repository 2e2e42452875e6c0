//! The opcodes run on a stack machine that builds the document's nodes: memo, marks, and the
//! checks that keep hostile input from panicking or allocating beyond its size.

use super::opcodes::{op, refused_name, unsupported_name};
use super::{Document, Node, NodeId, PickleError, PickleErrorKind};
use rustc_hash::FxHashMap;

struct Parser<'a> {
    input: &'a [u8],
    pos: usize,
    /// Where the opcode being read starts, for error messages.
    op_start: usize,
    nodes: Vec<Node<'a>>,
    stack: Vec<NodeId>,
    /// Stack heights at each open MARK; the items above the last one are the "current" stack.
    marks: Vec<usize>,
    /// Memo keys 0, 1, 2, ... as MEMOIZE assigns them.
    memo: Vec<NodeId>,
    /// Memo keys that BINPUT / LONG_BINPUT set out of order.
    memo_sparse: FxHashMap<u32, NodeId>,
}

impl<'a> Document<'a> {
    /// Reads a pickle (protocol 2 to 5) that holds only plain data.
    pub fn parse(input: &'a [u8]) -> Result<Document<'a>, PickleError> {
        if input.first() != Some(&op::PROTO) {
            return Err(PickleError {
                offset: 0,
                kind: PickleErrorKind::NotPickle,
            });
        }
        let mut parser = Parser {
            input,
            pos: 0,
            op_start: 0,
            // Snapshots hold roughly one node per 25 bytes; a guess, never a promise.
            nodes: Vec::with_capacity(input.len() / 25),
            stack: Vec::new(),
            marks: Vec::new(),
            memo: Vec::new(),
            memo_sparse: FxHashMap::default(),
        };
        let root = parser.run()?;
        Ok(Document {
            nodes: parser.nodes,
            root,
        })
    }
}

impl<'a> Parser<'a> {
    fn error(&self, kind: PickleErrorKind) -> PickleError {
        PickleError {
            offset: self.op_start,
            kind,
        }
    }

    fn malformed(&self, what: impl Into<String>) -> PickleError {
        self.error(PickleErrorKind::Malformed(what.into()))
    }

    fn take(&mut self, n: u64) -> Result<&'a [u8], PickleError> {
        let remaining = (self.input.len() - self.pos) as u64;
        if n > remaining {
            return Err(PickleError {
                offset: self.input.len(),
                kind: PickleErrorKind::Truncated,
            });
        }
        let start = self.pos;
        self.pos += n as usize;
        Ok(&self.input[start..self.pos])
    }

    fn take_array<const N: usize>(&mut self) -> Result<[u8; N], PickleError> {
        let bytes = self.take(N as u64)?;
        let mut out = [0u8; N];
        out.copy_from_slice(bytes);
        Ok(out)
    }

    fn u8(&mut self) -> Result<u8, PickleError> {
        Ok(self.take_array::<1>()?[0])
    }

    fn u32_le(&mut self) -> Result<u32, PickleError> {
        Ok(u32::from_le_bytes(self.take_array()?))
    }

    fn u64_le(&mut self) -> Result<u64, PickleError> {
        Ok(u64::from_le_bytes(self.take_array()?))
    }

    fn push_node(&mut self, node: Node<'a>) -> Result<(), PickleError> {
        let id = NodeId::try_from(self.nodes.len())
            .map_err(|_| self.malformed("more values than this reader can hold"))?;
        self.nodes.push(node);
        self.stack.push(id);
        Ok(())
    }

    /// The height below which the current stack (above the last MARK) may not shrink.
    fn floor(&self) -> usize {
        self.marks.last().copied().unwrap_or(0)
    }

    fn pop(&mut self) -> Result<NodeId, PickleError> {
        if self.stack.len() <= self.floor() {
            return Err(self.malformed("stack underflow"));
        }
        Ok(self.stack.pop().expect("checked above"))
    }

    fn top(&self) -> Result<NodeId, PickleError> {
        if self.stack.len() <= self.floor() {
            return Err(self.malformed("stack underflow"));
        }
        Ok(*self.stack.last().expect("checked above"))
    }

    /// Closes the last MARK and returns the stack height where its items start.
    fn pop_mark(&mut self) -> Result<usize, PickleError> {
        self.marks
            .pop()
            .ok_or_else(|| self.malformed("no MARK to close"))
    }

    fn memo_get(&self, key: u32) -> Result<NodeId, PickleError> {
        self.memo
            .get(key as usize)
            .or_else(|| self.memo_sparse.get(&key))
            .copied()
            .ok_or_else(|| self.malformed(format!("memo key {key} was never set")))
    }

    fn memo_put(&mut self, key: u32, id: NodeId) {
        if (key as usize) < self.memo.len() {
            self.memo[key as usize] = id;
        } else if key as usize == self.memo.len() && !self.memo_sparse.contains_key(&key) {
            self.memo.push(id);
        } else {
            self.memo_sparse.insert(key, id);
        }
    }

    fn container_items(&mut self, start: usize) -> Vec<NodeId> {
        self.stack.split_off(start)
    }

    fn push_int(&mut self, value: i128) -> Result<(), PickleError> {
        self.push_node(Node::Int(value))
    }

    fn push_long(&mut self, len: u64) -> Result<(), PickleError> {
        let bytes = self.take(len)?;
        let value = decode_long(bytes).ok_or_else(|| self.error(PickleErrorKind::IntTooLarge))?;
        self.push_int(value)
    }

    fn push_str(&mut self, len: u64) -> Result<(), PickleError> {
        let bytes = self.take(len)?;
        // Python writes str with 'surrogatepass'; lone surrogates become U+FFFD here.
        self.push_node(Node::Str(String::from_utf8_lossy(bytes)))
    }

    fn push_bytes(&mut self, len: u64) -> Result<(), PickleError> {
        let bytes = self.take(len)?;
        self.push_node(Node::Bytes(bytes))
    }

    fn push_tuple(&mut self, n: usize) -> Result<(), PickleError> {
        if self.stack.len() < self.floor() + n {
            return Err(self.malformed("stack underflow"));
        }
        let start = self.stack.len() - n;
        let items = self.container_items(start);
        self.push_node(Node::Tuple(items))
    }

    fn list_mut(&mut self, id: NodeId) -> Result<&mut Vec<NodeId>, PickleError> {
        match &mut self.nodes[id as usize] {
            Node::List(items) => Ok(items),
            _ => Err(PickleError {
                offset: self.op_start,
                kind: PickleErrorKind::Malformed("APPEND to a value that is no list".into()),
            }),
        }
    }

    fn dict_mut(&mut self, id: NodeId) -> Result<&mut Vec<(NodeId, NodeId)>, PickleError> {
        match &mut self.nodes[id as usize] {
            Node::Dict(entries) => Ok(entries),
            _ => Err(PickleError {
                offset: self.op_start,
                kind: PickleErrorKind::Malformed("SETITEM on a value that is no dict".into()),
            }),
        }
    }

    /// The class that GLOBAL / STACK_GLOBAL would load, for the refusal message.
    fn refused_class(&mut self, code: u8) -> Option<String> {
        let clean = |s: &str| -> String {
            s.chars()
                .take(80)
                .map(|c| if c.is_control() { '?' } else { c })
                .collect()
        };
        match code {
            op::GLOBAL | op::INST => {
                let rest = &self.input[self.pos..];
                let mut lines = rest.splitn(3, |&b| b == b'\n');
                let module = lines.next()?;
                let name = lines.next()?;
                Some(clean(&format!(
                    "{}.{}",
                    String::from_utf8_lossy(module),
                    String::from_utf8_lossy(name)
                )))
            }
            op::STACK_GLOBAL => {
                let n = self.stack.len();
                if n < 2 {
                    return None;
                }
                match (
                    &self.nodes[self.stack[n - 2] as usize],
                    &self.nodes[self.stack[n - 1] as usize],
                ) {
                    (Node::Str(module), Node::Str(name)) => {
                        Some(clean(&format!("{module}.{name}")))
                    }
                    _ => None,
                }
            }
            _ => None,
        }
    }

    fn run(&mut self) -> Result<NodeId, PickleError> {
        loop {
            self.op_start = self.pos;
            let code = self.u8()?;
            match code {
                op::PROTO => {
                    let version = self.u8()?;
                    if !(2..=5).contains(&version) {
                        return Err(self.error(PickleErrorKind::UnsupportedProtocol(version)));
                    }
                }
                op::FRAME => {
                    // Frames only group opcodes for buffered reading; the whole input is here.
                    let len = self.u64_le()?;
                    if len > (self.input.len() - self.pos) as u64 {
                        return Err(PickleError {
                            offset: self.input.len(),
                            kind: PickleErrorKind::Truncated,
                        });
                    }
                }
                op::STOP => {
                    return self.pop();
                }
                op::MARK => self.marks.push(self.stack.len()),
                op::POP => {
                    if self.stack.len() > self.floor() {
                        self.stack.pop();
                    } else {
                        // Python's POP on an empty current stack discards the MARK.
                        self.pop_mark()?;
                    }
                }
                op::POP_MARK => {
                    let start = self.pop_mark()?;
                    self.stack.truncate(start);
                }
                op::DUP => {
                    let top = self.top()?;
                    self.stack.push(top);
                }
                op::NONE => self.push_node(Node::None)?,
                op::NEWTRUE => self.push_node(Node::Bool(true))?,
                op::NEWFALSE => self.push_node(Node::Bool(false))?,
                op::BININT => {
                    let v = i32::from_le_bytes(self.take_array()?);
                    self.push_int(i128::from(v))?;
                }
                op::BININT1 => {
                    let v = self.u8()?;
                    self.push_int(i128::from(v))?;
                }
                op::BININT2 => {
                    let v = u16::from_le_bytes(self.take_array()?);
                    self.push_int(i128::from(v))?;
                }
                op::LONG1 => {
                    let len = self.u8()?;
                    self.push_long(u64::from(len))?;
                }
                op::LONG4 => {
                    let len = i32::from_le_bytes(self.take_array()?);
                    if len < 0 {
                        return Err(self.malformed("LONG4 with a negative length"));
                    }
                    self.push_long(len as u64)?;
                }
                op::BINFLOAT => {
                    let v = f64::from_be_bytes(self.take_array()?);
                    self.push_node(Node::Float(v))?;
                }
                op::SHORT_BINUNICODE => {
                    let len = self.u8()?;
                    self.push_str(u64::from(len))?;
                }
                op::BINUNICODE => {
                    let len = self.u32_le()?;
                    self.push_str(u64::from(len))?;
                }
                op::BINUNICODE8 => {
                    let len = self.u64_le()?;
                    self.push_str(len)?;
                }
                op::SHORT_BINBYTES => {
                    let len = self.u8()?;
                    self.push_bytes(u64::from(len))?;
                }
                op::BINBYTES => {
                    let len = self.u32_le()?;
                    self.push_bytes(u64::from(len))?;
                }
                op::BINBYTES8 | op::BYTEARRAY8 => {
                    let len = self.u64_le()?;
                    self.push_bytes(len)?;
                }
                op::EMPTY_DICT => self.push_node(Node::Dict(Vec::new()))?,
                op::EMPTY_LIST => self.push_node(Node::List(Vec::new()))?,
                op::EMPTY_TUPLE => self.push_node(Node::Tuple(Vec::new()))?,
                op::TUPLE => {
                    let start = self.pop_mark()?;
                    let items = self.container_items(start);
                    self.push_node(Node::Tuple(items))?;
                }
                op::TUPLE1 => self.push_tuple(1)?,
                op::TUPLE2 => self.push_tuple(2)?,
                op::TUPLE3 => self.push_tuple(3)?,
                op::LIST => {
                    let start = self.pop_mark()?;
                    let items = self.container_items(start);
                    self.push_node(Node::List(items))?;
                }
                op::DICT => {
                    let start = self.pop_mark()?;
                    let items = self.container_items(start);
                    let entries = pairs(&items).ok_or_else(|| {
                        self.malformed("DICT with an odd number of keys and values")
                    })?;
                    self.push_node(Node::Dict(entries))?;
                }
                op::APPEND => {
                    let value = self.pop()?;
                    let list = self.top()?;
                    self.list_mut(list)?.push(value);
                }
                op::APPENDS => {
                    let start = self.pop_mark()?;
                    let items = self.container_items(start);
                    let list = self.top()?;
                    self.list_mut(list)?.extend_from_slice(&items);
                }
                op::SETITEM => {
                    let value = self.pop()?;
                    let key = self.pop()?;
                    let dict = self.top()?;
                    self.dict_mut(dict)?.push((key, value));
                }
                op::SETITEMS => {
                    let start = self.pop_mark()?;
                    let items = self.container_items(start);
                    let dict = self.top()?;
                    let entries = pairs(&items).ok_or_else(|| {
                        self.malformed("SETITEMS with an odd number of keys and values")
                    })?;
                    self.dict_mut(dict)?.extend_from_slice(&entries);
                }
                op::MEMOIZE => {
                    let top = self.top()?;
                    let key = u32::try_from(self.memo.len() + self.memo_sparse.len())
                        .map_err(|_| self.malformed("memo overflow"))?;
                    self.memo_put(key, top);
                }
                op::BINPUT => {
                    let key = self.u8()?;
                    let top = self.top()?;
                    self.memo_put(u32::from(key), top);
                }
                op::LONG_BINPUT => {
                    let key = self.u32_le()?;
                    let top = self.top()?;
                    self.memo_put(key, top);
                }
                op::BINGET => {
                    let key = self.u8()?;
                    let id = self.memo_get(u32::from(key))?;
                    self.stack.push(id);
                }
                op::LONG_BINGET => {
                    let key = self.u32_le()?;
                    let id = self.memo_get(key)?;
                    self.stack.push(id);
                }
                other => {
                    if let Some(opcode) = refused_name(other) {
                        let what = self.refused_class(other);
                        return Err(self.error(PickleErrorKind::Refused { opcode, what }));
                    }
                    if let Some(opcode) = unsupported_name(other) {
                        return Err(self.error(PickleErrorKind::Unsupported { opcode }));
                    }
                    return Err(self.error(PickleErrorKind::UnknownOpcode(other)));
                }
            }
        }
    }
}

fn pairs(items: &[NodeId]) -> Option<Vec<(NodeId, NodeId)>> {
    if !items.len().is_multiple_of(2) {
        return None;
    }
    Some(items.chunks_exact(2).map(|kv| (kv[0], kv[1])).collect())
}

/// LONG1 / LONG4 payload: little-endian two's complement.
fn decode_long(bytes: &[u8]) -> Option<i128> {
    if bytes.len() > 16 {
        return None;
    }
    let negative = bytes.last().is_some_and(|b| b & 0x80 != 0);
    let mut buf = if negative { [0xff; 16] } else { [0; 16] };
    buf[..bytes.len()].copy_from_slice(bytes);
    Some(i128::from_le_bytes(buf))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_decoding() {
        assert_eq!(decode_long(&[]), Some(0));
        assert_eq!(decode_long(&[0xff]), Some(-1));
        assert_eq!(decode_long(&[0x00, 0x80]), Some(-32768));
        assert_eq!(decode_long(&[0xff, 0x00]), Some(255));
        assert_eq!(decode_long(&[0; 17]), None);
    }
}
