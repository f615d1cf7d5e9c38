// The chat page: streams replies from /v1/chat/completions, keeps the conversation and settings in
// localStorage and the API key (when the server asks for one) in sessionStorage.
'use strict';

const $ = (id) => document.getElementById(id);
const CHAT_KEY = 'lmdeploy.chat';
const SETTINGS_KEY = 'lmdeploy.settings';
const API_KEY = 'lmdeploy.apiKey';

const state = {
  model: null,
  messages: load(CHAT_KEY, []), // {role, content, images?, meta?, error?}
  pending: [], // data URLs attached to the next message
  controller: null,
};

function load(key, fallback) {
  try {
    return JSON.parse(localStorage.getItem(key)) ?? fallback;
  } catch {
    return fallback;
  }
}

function save() {
  try {
    localStorage.setItem(CHAT_KEY, JSON.stringify(state.messages));
  } catch (err) {
    setStatus(`the conversation is too large to keep in this browser (${err.name})`);
  }
}

function headers() {
  const key = sessionStorage.getItem(API_KEY);
  return {'Content-Type': 'application/json', ...(key ? {Authorization: `Bearer ${key}`} : {})};
}

function setStatus(text) {
  $('status').textContent = text;
}

function askForKey(message) {
  $('key-form').hidden = false;
  $('api-key').focus();
  setStatus(message);
}

async function fetchModel() {
  const response = await fetch('/v1/models', {headers: headers()});
  if (response.status === 401) {
    askForKey('enter an API key to chat');
    return;
  }
  const body = await response.json();
  state.model = body.data[0].id;
  $('model').textContent = state.model;
  $('key-form').hidden = true;
  setStatus('');
}

function messageElement(message) {
  const div = document.createElement('div');
  div.className = `message ${message.role}${message.error ? ' error' : ''}`;
  for (const url of message.images || []) {
    const img = document.createElement('img');
    img.src = url;
    img.alt = 'attached image';
    div.appendChild(img);
  }
  const body = document.createElement('div');
  body.className = 'body';
  div.appendChild(body);
  const meta = document.createElement('div');
  meta.className = 'meta';
  div.appendChild(meta);
  fillMessage(div, message);
  return div;
}

function fillMessage(div, message) {
  const body = div.querySelector('.body');
  if (message.role === 'assistant' && !message.error) body.innerHTML = window.renderMarkdown(message.content);
  else body.textContent = message.content;
  div.querySelector('.meta').textContent = message.meta || '';
}

function renderAll() {
  const main = $('messages');
  main.replaceChildren(...state.messages.map(messageElement));
  main.scrollTop = main.scrollHeight;
}

function settings() {
  return {system: $('system-prompt').value, temperature: $('temperature').value, maxTokens: $('max-tokens').value};
}

function apiMessages() {
  const out = [];
  const system = settings().system.trim();
  if (system) out.push({role: 'system', content: system});
  for (const m of state.messages) {
    if (m.error) continue;
    if (m.images && m.images.length) {
      const parts = m.images.map((url) => ({type: 'image_url', image_url: {url}}));
      out.push({role: m.role, content: [...parts, {type: 'text', text: m.content}]});
    } else {
      out.push({role: m.role, content: m.content});
    }
  }
  return out;
}

function requestBody() {
  const {temperature, maxTokens} = settings();
  const body = {model: state.model, messages: apiMessages(), stream: true, stream_options: {include_usage: true}};
  if (temperature !== '') body.temperature = Number(temperature); // unset: the model's default
  if (maxTokens !== '') body.max_tokens = Number(maxTokens);
  return body;
}

// Yields the JSON payload of each server-sent event of a streamed response until [DONE].
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = '';
  for (;;) {
    const {done, value} = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, {stream: true});
    let end;
    while ((end = buffer.indexOf('\n\n')) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split('\n').filter((l) => l.startsWith('data:')).map((l) => l.slice(5).trim()).join('');
      if (data === '[DONE]') return;
      if (data) yield JSON.parse(data);
    }
  }
}

function setBusy(busy) {
  $('send').hidden = busy;
  $('stop').hidden = !busy;
}

async function send(text) {
  if (!state.model) await fetchModel();
  if (!state.model) return;
  state.messages.push({role: 'user', content: text, images: state.pending});
  state.pending = [];
  $('attachments').replaceChildren();
  const body = JSON.stringify(requestBody());
  const reply = {role: 'assistant', content: '', meta: '…'};
  state.messages.push(reply);
  renderAll();
  const div = $('messages').lastElementChild;
  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  let finish = null;
  let tokens = 0;
  let first = null;
  const start = performance.now();
  try {
    const response = await fetch('/v1/chat/completions', {
      method: 'POST', headers: headers(), body, signal: controller.signal});
    if (!response.ok) {
      const error = await response.json().catch(() => ({}));
      if (response.status === 401) askForKey('the server needs an API key');
      throw new Error(error.error?.message || `HTTP ${response.status}`);
    }
    for await (const chunk of events(response)) {
      if (chunk.error) throw new Error(chunk.error.message || 'the server reported an error');
      for (const choice of chunk.choices || []) {
        const delta = choice.delta?.content || '';
        if (delta && first === null) first = performance.now();
        reply.content += delta;
        if (choice.finish_reason) finish = choice.finish_reason;
      }
      if (chunk.usage) tokens = chunk.usage.completion_tokens;
      reply.meta = '…';
      fillMessage(div, reply);
      $('messages').scrollTop = $('messages').scrollHeight;
    }
  } catch (err) {
    if (err.name === 'AbortError') {
      finish = 'stopped';
    } else {
      reply.error = true;
      reply.content = reply.content ? `${reply.content}\n\n[error: ${err.message}]` : `error: ${err.message}`;
    }
  } finally {
    state.controller = null;
    setBusy(false);
  }
  const seconds = (performance.now() - (first ?? start)) / 1000;
  const rate = tokens && seconds > 0 ? `${(tokens / seconds).toFixed(1)} tokens/s · ` : '';
  reply.meta = reply.error ? '' : `${tokens ? `${tokens} tokens · ` : ''}${rate}finish: ${finish || 'unknown'}`;
  fillMessage(div, reply);
  save();
}

function attach(files) {
  for (const file of files) {
    const reader = new FileReader();
    reader.onload = () => {
      state.pending.push(reader.result);
      const img = document.createElement('img');
      img.src = reader.result;
      img.alt = file.name;
      $('attachments').appendChild(img);
    };
    reader.readAsDataURL(file);
  }
}

function init() {
  const saved = load(SETTINGS_KEY, {});
  $('system-prompt').value = saved.system || '';
  $('temperature').value = saved.temperature ?? '';
  $('max-tokens').value = saved.maxTokens ?? '';
  $('settings').addEventListener('input', () => localStorage.setItem(SETTINGS_KEY, JSON.stringify(settings())));
  $('settings').addEventListener('submit', (e) => e.preventDefault());
  $('settings-toggle').addEventListener('click', () => { $('settings').hidden = !$('settings').hidden; });
  $('new-chat').addEventListener('click', () => {
    if (state.controller) state.controller.abort();
    state.messages = [];
    save();
    renderAll();
  });
  $('key-form').addEventListener('submit', (e) => {
    e.preventDefault();
    sessionStorage.setItem(API_KEY, $('api-key').value.trim());
    fetchModel();
  });
  $('image-input').addEventListener('change', (e) => { attach(e.target.files); e.target.value = ''; });
  $('stop').addEventListener('click', () => state.controller?.abort());
  $('composer').addEventListener('submit', (e) => {
    e.preventDefault();
    const text = $('prompt').value.trim();
    if (!text || state.controller) return;
    $('prompt').value = '';
    send(text);
  });
  $('prompt').addEventListener('keydown', (e) => {
    if (e.key === 'Enter' && !e.shiftKey) {
      e.preventDefault();
      $('composer').requestSubmit();
    }
  });
  renderAll();
  fetchModel();
}

init();
