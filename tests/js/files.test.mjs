import { test } from 'node:test'
import assert from 'node:assert/strict'
import { FileType, FilesystemEventType, NotFoundError } from 'e2b'
import { sandbox, waitFor } from './helpers.mjs'

test('write, read, list, rename, remove', async () => {
  const sbx = await sandbox()
  const info = await sbx.files.write('/home/user/dir/a.txt', 'héllo ✓')
  assert.equal(info.path, '/home/user/dir/a.txt')
  assert.equal(await sbx.files.read('/home/user/dir/a.txt'), 'héllo ✓')
  const bytes = await sbx.files.read('/home/user/dir/a.txt', { format: 'bytes' })
  assert.equal(new TextDecoder().decode(bytes), 'héllo ✓')

  // Several files in one request, and a streamed (octet-stream) upload.
  await sbx.files.write([
    { path: '/home/user/dir/b.txt', data: 'b' },
    { path: '/home/user/dir/c.bin', data: new Uint8Array([0, 1, 2, 255]).buffer },
  ])
  await sbx.files.write('/home/user/dir/d.txt', 'streamed', { useOctetStream: true })
  const names = (await sbx.files.list('/home/user/dir')).map((e) => [e.name, e.type]).sort()
  assert.deepEqual(names, [['a.txt', FileType.FILE], ['b.txt', FileType.FILE], ['c.bin', FileType.FILE],
    ['d.txt', FileType.FILE]])
  assert.deepEqual([...await sbx.files.read('/home/user/dir/c.bin', { format: 'bytes' })], [0, 1, 2, 255])

  assert.equal(await sbx.files.makeDir('/home/user/dir/sub'), true)
  await sbx.files.rename('/home/user/dir/b.txt', '/home/user/dir/sub/b.txt')
  assert.equal(await sbx.files.exists('/home/user/dir/b.txt'), false)
  assert.equal(await sbx.files.read('/home/user/dir/sub/b.txt'), 'b')
  await sbx.files.remove('/home/user/dir/sub')
  assert.equal(await sbx.files.exists('/home/user/dir/sub'), false)
  await assert.rejects(sbx.files.read('/home/user/nope.txt'), NotFoundError)
  assert.equal((await sbx.commands.run('stat -c %U /home/user/dir/a.txt')).stdout, 'user\n')
})

test('watchDir streams events until stopped', async () => {
  const sbx = await sandbox()
  await sbx.files.makeDir('/home/user/watched')
  const events = []
  const handle = await sbx.files.watchDir('/home/user/watched', (e) => events.push(e), { recursive: true })
  await sbx.files.write('/home/user/watched/created.txt', 'x')
  await sbx.commands.run('mkdir -p /home/user/watched/deep && touch /home/user/watched/deep/inner.txt')
  await waitFor('the watch events', () =>
    events.some((e) => e.name === 'created.txt' && e.type === FilesystemEventType.CREATE) &&
    events.some((e) => e.name.endsWith('inner.txt')))
  await handle.stop()
  const count = events.length
  await sbx.files.write('/home/user/watched/after-stop.txt', 'x')
  await new Promise((r) => setTimeout(r, 300))
  assert.equal(events.length, count, 'events arrived after stop()')
})

test('signed download and upload URLs work without headers', async () => {
  const sbx = await sandbox()
  await sbx.files.write('/home/user/shared.txt', 'signed ✓')
  const download = await sbx.downloadUrl('/home/user/shared.txt')
  assert.match(download, /signature=/)
  const got = await fetch(download)
  assert.equal(got.status, 200)
  assert.equal(await got.text(), 'signed ✓')

  const form = new FormData()
  form.append('file', new Blob(['uploaded through a link']), 'up.txt')
  const up = await fetch(await sbx.uploadUrl('/home/user/up.txt'), { method: 'POST', body: form })
  assert.ok(up.ok, `upload answered ${up.status}`)
  assert.equal(await sbx.files.read('/home/user/up.txt'), 'uploaded through a link')

  const tampered = download.replace(/signature=([^&]+)/, (_, s) => `signature=${s.slice(0, -2)}AA`)
  assert.ok([401, 403, 404].includes((await fetch(tampered)).status))
})
