// Every kind of stream a client can cancel, each followed at once by a
// request with a body, many times over: none may be lost. (The agent once
// closed connections with the tail of a multipart body unread, and the
// gateway, still sending that tail, answered 502 instead of the response.)
import { test } from 'node:test'
import assert from 'node:assert/strict'
import { sandbox } from './helpers.mjs'

const ROUNDS = Number(process.env.COPSE_JS_RACE_ROUNDS || 300)

const cancellers = {
  async watchDir(sbx) {
    const watch = await sbx.files.watchDir('/home/user', () => {})
    await watch.stop()
  },
  async backgroundCommand(sbx) {
    const handle = await sbx.commands.run('sleep 30', { background: true })
    await handle.disconnect()
    return () => sbx.commands.kill(handle.pid)
  },
  async reconnectedCommand(sbx, shared) {
    const handle = await sbx.commands.connect(shared.sleeper)
    await handle.disconnect()
  },
  async pty(sbx) {
    const pty = await sbx.pty.create({ cols: 80, rows: 24, onData: () => {} })
    await pty.disconnect()
    return () => sbx.pty.kill(pty.pid)
  },
  async download(sbx, shared) {
    const response = await fetch(shared.bigUrl)
    const reader = response.body.getReader()
    await reader.read()
    await reader.cancel()
  },
}

test('no request is lost after a cancelled stream', { timeout: 600_000 }, async () => {
  const sbx = await sandbox({ timeoutMs: 600_000 })
  await sbx.commands.run('head -c 8M /dev/urandom > /home/user/big.bin')
  const shared = {
    sleeper: (await sbx.commands.run('sleep 600', { background: true })).pid,
    bigUrl: await sbx.downloadUrl('/home/user/big.bin'),
  }
  const failures = []
  for (const [kind, cancel] of Object.entries(cancellers)) {
    for (let i = 0; i < ROUNDS; i++) {
      const cleanup = await cancel(sbx, shared)
      const path = `/home/user/after-${kind}.txt`
      try {
        // Alternate the two upload encodings the SDK uses.
        await sbx.files.write(path, `${kind} ${i}`, { useOctetStream: i % 2 === 1 })
      } catch (e) {
        failures.push(`${kind} #${i}: ${e.message}`)
      }
      if (cleanup) await cleanup()
    }
    assert.equal(await sbx.files.read(`/home/user/after-${kind}.txt`), `${kind} ${ROUNDS - 1}`)
  }
  assert.deepEqual(failures, [])
})
